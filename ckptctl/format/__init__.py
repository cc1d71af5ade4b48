"""The safetensors format layer: headers, dtypes and the index file. Never imports torch."""
