"""Ready recipes (YAML) and the accelerate configs beside them."""
