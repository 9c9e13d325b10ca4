"""`python -m pagedllm ...` runs the CLI, exactly as the `pagedllm` command does."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
