"""Training: the one loop and its session; strategy, precision, model set-up, batch math, failure handling and checkpoint I/O each in its own module."""
