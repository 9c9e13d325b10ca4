"""What every protocol dialect shares (see pagedllm/protocols/__init__.py)."""
