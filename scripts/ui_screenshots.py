"""Screenshots of the chat page for docs/ui.md, taken in Debian's chromium.

    ember serve &
    python scripts/ui_screenshots.py [--url http://127.0.0.1:8000] [--key KEY]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--key", default="")
    p.add_argument("--out", type=Path, default=Path("docs/images"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
        context = browser.new_context(viewport={"width": 1100, "height": 720},
                                      http_credentials={"username": "me", "password": args.key}
                                      if args.key else None)
        page = context.new_page()
        page.goto(args.url + "/")
        page.get_by_role("button", name="Settings").click()
        dialog = page.get_by_role("dialog", name="Settings")
        dialog.get_by_label("API key", exact=True).fill(args.key)
        dialog.get_by_label("Temperature", exact=True).fill("0")
        dialog.get_by_label("Max tokens", exact=True).fill("160")
        dialog.get_by_label("System prompt", exact=True).fill("You are a concise assistant.")
        page.screenshot(path=args.out / "ui-settings.png")
        dialog.get_by_role("button", name="Save").click()
        for question in ("How do I reverse a list in Python? Show code.",
                         "And how do I sort it in descending order?"):
            page.get_by_label("Message", exact=True).fill(question)
            page.get_by_role("button", name="Send").click()
            page.wait_for_function(
                "() => { const a = document.querySelectorAll('article[aria-label=Assistant]');"
                " return a.length && a[a.length - 1].dataset.state === 'done'; }",
                timeout=120_000)
        page.screenshot(path=args.out / "ui-chat.png")
        browser.close()
    print(f"wrote {args.out / 'ui-chat.png'} and {args.out / 'ui-settings.png'}")


if __name__ == "__main__":
    main()
