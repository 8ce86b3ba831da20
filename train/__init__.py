"""Training stage: training-time test loss and the accelerate loop."""
