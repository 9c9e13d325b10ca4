"""Speculative decoding: proposals from n-gram prompt lookup or a small draft model, verified by
the target model in one forward."""
