"""What the console prints is the text itself: job section names in brackets are not eaten as rich markup, and
the demo's log lines carry no source location."""

from __future__ import annotations

from rich.console import Console

from feta_release.training.progress import Reporter


def test_warning_keeps_bracketed_job_sections() -> None:
    con = Console(record=True, width=200)
    Reporter(console=con).warn("[sampler] noise is mostly noise: lower [central] sigma or rounds")
    assert "[sampler] noise is mostly noise: lower [central] sigma or rounds" in con.export_text()


def test_demo_log_lines_have_no_source_location() -> None:
    import io

    from coordinator.demo import demo_console

    out = io.StringIO()
    demo_console(out).log("[central] released")
    assert "demo.py" not in out.getvalue() and "released" in out.getvalue()
