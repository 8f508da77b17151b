"""Target service: the large model that verifies draft tokens over a paged KV cache."""
