"""What a rank holds and sends, measured; the device memory check."""
