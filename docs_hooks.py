"""mkdocs hooks: the site's home page is README.md, so the two never disagree."""

from pathlib import Path


def on_page_read_source(page, config):  # noqa: D103
    if page.file.src_uri == "index.md":
        readme = Path(config.config_file_path).parent / "README.md"
        return readme.read_text().replace("](docs/", "](")
    return None
