"""Model building blocks, tensor-parallel ready: linear, embedding, norm, rotary, attention, sampler."""
