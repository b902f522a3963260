"""The Markdown a chapter displays its sentences in (each chapter's `lines`, the findings page's verdicts)."""


def bullets(lines: list[str]) -> str:
    """The sentences as a bulleted list, for a notebook's Markdown display."""
    return "\n".join(f"- {line}" for line in lines)
