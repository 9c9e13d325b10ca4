"""Speculative decoding: n-gram prompt lookup and a draft model, verified by the target in one forward."""
