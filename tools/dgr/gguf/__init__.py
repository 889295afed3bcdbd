"""Reading GGUF files: headers, tensors, which layer owns each tensor (`model`), and what the weights
weigh per layer and role (`weights`). Imports only dgr.core."""
