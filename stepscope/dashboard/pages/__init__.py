"""The dashboard's pages; each registers itself with Dash Pages when imported."""

PAGE_MODULES = (
    "stepscope.dashboard.pages.jobs",
    "stepscope.dashboard.pages.job",
    "stepscope.dashboard.pages.rank",
    "stepscope.dashboard.pages.compare",
    "stepscope.dashboard.pages.fleet",
    "stepscope.dashboard.pages.not_found_404",
)
"""Imported after the Dash app exists (Dash Pages requires it). Each page's `order` puts
the rank page before the job page: Dash matches `<job_id>` across slashes."""
