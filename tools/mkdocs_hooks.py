"""MkDocs hook: a page's `<!-- engine-options -->` line becomes the table of the engine's
options, generated from their declarations (pagedllm/config/table.py), so the site lists the
options the code has and nothing else."""

MARKER = "<!-- engine-options -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from pagedllm.config.table import markdown as options_table

    return markdown.replace(MARKER, options_table())
