"""The inference engine: the model and its weights, tokenizers, sampling, the paged KV cache and the
continuous-batching loop. Knows nothing of gRPC or Redis; the services wrap it."""
