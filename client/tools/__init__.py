"""Tools around the product: the stress tool, quantization parity and calibration studies."""
