"""eyas: train EAGLE-3 draft heads and prove, by measurement, that they make the target faster."""

__version__ = "0.1.0"
