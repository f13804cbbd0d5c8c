"""The transformers zoo: tiny configs of many architectures, and what every one must pass."""
