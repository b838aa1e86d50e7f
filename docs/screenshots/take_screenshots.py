"""docs/screenshots: the MLflow UI after the README's walkthrough (headless Debian chromium, driven by playwright)."""
import sys
from playwright.sync_api import sync_playwright

base, out = sys.argv[1], sys.argv[2]
RUNS = "/#/experiments/1/runs"


def expander(page, row_text):
    row = page.locator(".ag-row", has_text=row_text).first
    row.locator('[data-component-id$="runnamecellrenderer.tsx_46"]').first.click()
    page.wait_for_timeout(1200)


with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
    page = b.new_page(viewport={"width": 1400, "height": 720})
    page.goto(base + RUNS)
    page.wait_for_timeout(5000)
    page.get_by_text("Model training", exact=True).first.click()  # MLflow 3.x's GenAI / Model training switch (kept)
    page.wait_for_timeout(2500)
    page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]').first.click()
    page.get_by_text("Columns").first.click()
    page.wait_for_timeout(800)
    for name in ("Dataset", "Source", "Models", "Description"):
        page.get_by_text(name, exact=True).last.click()
        page.wait_for_timeout(400)
    page.keyboard.press("Escape")
    page.wait_for_timeout(800)
    handle = page.locator(".ag-header-cell-resize").nth(1)
    box = handle.bounding_box()
    page.mouse.move(box["x"] + 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + 150, box["y"] + box["height"] / 2, steps=8)
    page.mouse.up()
    page.wait_for_timeout(800)
    expander(page, "train nan_forward")
    expander(page, "train ablate_lr_explosion")
    page.screenshot(path=f"{out}/runs.png")
    expander(page, "ablate @ step 47 (lr, clip, precision)")
    page.screenshot(path=f"{out}/ablation-arms.png")
    page.get_by_text("ablate @ step 47 (lr, clip, precision)", exact=True).first.click()
    page.wait_for_timeout(2500)
    page.screenshot(path=f"{out}/ablation-report.png")
    page.goto(base + RUNS)  # two clicks from the run list to a nan report
    page.wait_for_timeout(4000)
    if not page.get_by_text("nan @ step 20", exact=True).count():
        expander(page, "train nan_forward")
    page.get_by_text("nan @ step 20", exact=True).first.click()
    page.wait_for_timeout(2500)
    page.screenshot(path=f"{out}/nan-report.png")
    b.close()
