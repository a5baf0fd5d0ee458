"""Model definitions: single-device model code plus a `parallelize` module per family."""
