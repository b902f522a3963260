"""Screenshots of what a reader sees first: README.md as GitHub renders it, and the reference book's findings and
chooser chapters, in headless Chromium at 1,000 px wide (issue 65's "What it must show").

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/screenshots.py [--out benchmarks/results/screenshots]

README.md is rendered with markdown-it-py (CommonMark plus GitHub's tables and strikethrough, raw HTML kept as GitHub
hides its comments) under a plain GitHub-like stylesheet, its relative links and images resolved against the
repository, so the overview figure shows. The chapters are the stored executed notebooks of the published reference
book (`reference/embedded/chapters/{findings,choose}.ipynb`), converted by nbconvert's HTML exporter without
executing anything; cells tagged `remove-cell` are dropped and `hide-input` cells show their outputs only, as the book
does. Each page gets a first-screen shot (1,000 x 1,000) and a full-page shot (1,000 px wide, cut at --max-height).
Chromium comes from $CHROMIUM, else `chromium`, `chromium-browser` or `google-chrome` on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 1000
FIRST_SCREEN = 1000
MAX_BYTES = 600_000
CHAPTERS = {
    "findings": "reference/embedded/chapters/findings.ipynb",
    "choose": "reference/embedded/chapters/choose.ipynb",
}
INSTALL_HINT = (
    "Chromium not found: install it (Debian/Ubuntu: `apt-get install -y chromium`) or set $CHROMIUM to its path."
)

# A plain stylesheet after GitHub's own (github-markdown-css, light theme), the file view's 980 px column.
GITHUB_CSS = """
body { margin: 0; background: #ffffff; }
.markdown-body { box-sizing: border-box; max-width: 980px; margin: 0 auto; padding: 32px 45px;
  font-family: -apple-system, BlinkMacSystemFont, "Segoe UI", "Noto Sans", Helvetica, Arial, sans-serif;
  font-size: 16px; line-height: 1.5; color: #1f2328; word-wrap: break-word; }
.markdown-body h1, .markdown-body h2 { padding-bottom: .3em; border-bottom: 1px solid #d1d9e0; }
.markdown-body h1 { font-size: 2em; margin: .67em 0 16px; font-weight: 600; }
.markdown-body h2 { font-size: 1.5em; margin: 24px 0 16px; font-weight: 600; }
.markdown-body h3 { font-size: 1.25em; margin: 24px 0 16px; font-weight: 600; }
.markdown-body p, .markdown-body ul, .markdown-body ol, .markdown-body table, .markdown-body pre { margin: 0 0 16px; }
.markdown-body a { color: #0969da; text-decoration: none; }
.markdown-body strong { font-weight: 600; }
.markdown-body code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace;
  font-size: 85%; padding: .2em .4em; background: #eff1f3; border-radius: 6px; }
.markdown-body pre { padding: 16px; overflow: auto; font-size: 85%; line-height: 1.45; background: #f6f8fa;
  border-radius: 6px; }
.markdown-body pre code { padding: 0; background: transparent; font-size: 100%; }
.markdown-body table { display: block; width: max-content; max-width: 100%; overflow: auto; border-spacing: 0;
  border-collapse: collapse; }
.markdown-body th { font-weight: 600; }
.markdown-body th, .markdown-body td { padding: 6px 13px; border: 1px solid #d1d9e0; }
.markdown-body tr { background: #ffffff; border-top: 1px solid #d1d9e0b3; }
.markdown-body tr:nth-child(2n) { background: #f6f8fa; }
.markdown-body img { max-width: 100%; box-sizing: content-box; background: #ffffff; }
"""


def find_chromium() -> str:
    candidates = [os.environ.get("CHROMIUM", "")] + [
        shutil.which(name) or "" for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    ]
    for path in candidates:
        if path and Path(path).exists():
            return path
    sys.exit(INSTALL_HINT)


def readme_html() -> str:
    """README.md as GitHub-flavoured Markdown: tables and strikethrough; relative links resolved against the repo."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
    body = md.render((ROOT / "README.md").read_text(encoding="utf-8"))
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f'<base href="{ROOT.as_uri()}/"><title>README.md</title><style>{GITHUB_CSS}</style></head>'
        f'<body><article class="markdown-body">{body}</article></body></html>'
    )


def notebook_html(path: Path) -> str:
    """A stored executed notebook as HTML, not executed: the book's remove-cell and hide-input tags applied."""
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    notebook = nbformat.read(path, as_version=4)
    tags = TagRemovePreprocessor(
        remove_cell_tags={"remove-cell", "parameters", "injected-parameters"},
        remove_input_tags={"hide-input", "remove-input"},
        remove_all_outputs_tags={"remove-output"},
        enabled=True,
    )
    exporter = HTMLExporter(template_name="lab", exclude_input_prompt=True, exclude_output_prompt=True)
    exporter.register_preprocessor(tags, enabled=True)
    body, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"path": str(path.parent)}})
    # Offline: no CDN scripts (MathJax, require.js) to wait for; the pages hold no math.
    body = re.sub(r'<script[^>]+src="https?://[^"]+"[^>]*>\s*</script>', "", body)
    return body


def chromium_run(chromium: str, args: list[str], url: str) -> subprocess.CompletedProcess:
    command = [
        chromium,
        "--headless",
        "--disable-gpu",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--no-first-run",
        "--disable-extensions",
        "--mute-audio",
        *args,
        url,
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def page_height(chromium: str, page: Path) -> int:
    """The page's laid-out height at WIDTH, read back from the DOM after a script wrote it into the title."""
    probe = page.with_name(page.stem + ".probe.html")
    script = (
        "<script>window.addEventListener('load', () => { document.title = 'HEIGHT=' + "
        "Math.ceil(document.documentElement.scrollHeight); });</script>"
    )
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", script + "</body>", 1), encoding="utf-8")
    done = chromium_run(
        chromium, [f"--window-size={WIDTH},{FIRST_SCREEN}", "--virtual-time-budget=5000", "--dump-dom"], probe.as_uri()
    )
    found = re.search(r"HEIGHT=(\d+)", done.stdout)
    return int(found.group(1)) if found else FIRST_SCREEN


def shoot(chromium: str, page: Path, png: Path, height: int) -> None:
    png.unlink(missing_ok=True)
    done = chromium_run(
        chromium,
        [f"--window-size={WIDTH},{height}", "--virtual-time-budget=5000", f"--screenshot={png}"],
        page.as_uri(),
    )
    if not png.exists():
        sys.exit(f"Chromium wrote no screenshot for {page.name} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    shrink(png)


def shrink(png: Path) -> None:
    """Keep a PNG under MAX_BYTES: an optimized 256-colour palette (text stays sharp), then 3/4 the size until it fits."""
    if png.stat().st_size <= MAX_BYTES:
        return
    from PIL import Image

    image = Image.open(png).convert("RGB")
    while True:
        image.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(png, optimize=True)
        if png.stat().st_size <= MAX_BYTES or image.width <= 250:
            return
        image = image.resize((int(image.width * 0.75), int(image.height * 0.75)), Image.LANCZOS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "screenshots")
    parser.add_argument("--max-height", type=int, default=12000, help="cut full-page shots at this many px")
    args = parser.parse_args()
    chromium = find_chromium()
    args.out.mkdir(parents=True, exist_ok=True)
    pages = {"readme": readme_html()}
    pages.update({name: notebook_html(ROOT / path) for name, path in CHAPTERS.items()})
    with tempfile.TemporaryDirectory(prefix="kvlib-shots-") as tmp:
        for name, text in pages.items():
            page = Path(tmp) / f"{name}.html"
            page.write_text(text, encoding="utf-8")
            shoot(chromium, page, args.out / f"{name}-first-screen.png", FIRST_SCREEN)
            full = page_height(chromium, page)
            height = min(full, args.max_height)
            shoot(chromium, page, args.out / f"{name}-full.png", height)
            cut = f" (cut from {full} px)" if full > height else ""
            for shot in ("first-screen", "full"):
                png = args.out / f"{name}-{shot}.png"
                size = png.stat().st_size // 1000
                print(
                    f"{png.relative_to(ROOT) if png.is_relative_to(ROOT) else png}: {size} KB"
                    + (cut if shot == "full" else "")
                )
    print(f"source pages: README.md; {'; '.join(CHAPTERS.values())} (Chromium: {chromium})")


if __name__ == "__main__":
    main()
