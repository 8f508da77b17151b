"""specdec: speculative decoding served as a gRPC draft / target / gateway trio.

This package holds what the services share: the model runtime (loading, our Llama
forward over a paged KV cache, int8 self-draft), the KV block manager, sampling
transforms and the rejection sampler, the tensor wire codec and the generated stubs.
"""
