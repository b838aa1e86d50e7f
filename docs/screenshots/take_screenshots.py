"""docs/screenshots: MLflow's DEFAULT runs view after make_runs.sh (no column added, none resized: what a user sees
first), with the failed runs expanded; headless Debian chromium driven by playwright. The one choice made is the
README's: MLflow 3's GenAI / Model training switch set to Model training (the browser keeps it).

    mlflow server --backend-store-uri sqlite:////tmp/uidemo/mlflow.db --port 5055 &
    python docs/screenshots/take_screenshots.py http://127.0.0.1:5055 docs/screenshots
"""
import sys

from playwright.sync_api import sync_playwright

base, out = sys.argv[1], sys.argv[2]
RUNS = "/#/experiments/1/runs?workflowType=machine_learning"  # MLflow 3's Model training pages


def open_runs(page):
    page.goto(base + RUNS)
    page.wait_for_selector(".ag-row", timeout=120_000)
    page.wait_for_timeout(3000)
    close_assistant(page)


def close_assistant(page):
    """MLflow 3.x opens its assistant panel beside the table now and then; it is no part of the runs view."""
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close.count():
        close.first.click()
        page.wait_for_timeout(800)


def expand(page, row_text):
    row = page.locator(".ag-row", has_text=row_text).first
    row.locator('[data-component-id$="runnamecellrenderer.tsx_46"]').first.click()
    page.wait_for_timeout(1500)
    close_assistant(page)


def name_width(page) -> int:
    header = page.locator(".ag-header-cell", has_text="Run Name").first
    return round(header.bounding_box()["width"])


with sync_playwright() as p:
    browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
    page = browser.new_page(viewport={"width": 1400, "height": 720})
    page.goto(base + "/#/experiments/1/runs")  # a first visit opens MLflow 3's GenAI pages:
    page.wait_for_timeout(8000)
    page.get_by_text("Model training", exact=True).first.click()  # the README's one-time choice, kept by the browser
    page.wait_for_timeout(2500)
    open_runs(page)
    print(f"Run Name column: {name_width(page)} px")
    expand(page, "train nan_forward")
    expand(page, "train ablate_lr_explosion")
    page.screenshot(path=f"{out}/runs.png")
    expand(page, "· ablate @ step 57")  # the ablation under the lr run (its name leads with its answer)
    page.screenshot(path=f"{out}/ablation-arms.png")
    for row_text, picture in (("· ablate @ step 57", "ablation-report"), ("· nan @ step 20", "nan-report"),
                              ("fixes · triage", "triage-report")):
        open_runs(page)  # two clicks from the run list to a report
        if not page.locator(".ag-row", has_text=row_text).count():
            expand(page, "train nan_forward" if "20" in row_text else "train ablate_lr_explosion")
        page.locator(".ag-row", has_text=row_text).first.locator("a").first.click()
        page.wait_for_timeout(2500)
        page.screenshot(path=f"{out}/{picture}.png")
    browser.close()
