"""Capture: dynamo + aot_autograd give ATen FX graphs (inference, or training forward and backward)."""
