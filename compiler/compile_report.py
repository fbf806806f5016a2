"""What `tilertc compile` shows: the driver's stages while they run, then what was built."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import Progress, ProgressColumn, SpinnerColumn, Task, TaskID, TextColumn
from rich.table import Column, Table
from rich.text import Text

from tilertc.passes.pipeline import FP8_PATH


class SecondsColumn(ProgressColumn):
    """Elapsed time of a stage in tenths of a second (rich's own column counts whole seconds,
    and most stages take less than one)."""

    def render(self, task: Task) -> Text:
        seconds = (task.finished_time if task.finished else task.elapsed) or 0.0
        return Text(f"{seconds:6.1f} s", style="progress.elapsed")


class StageDisplay:
    """The driver's `progress` callback as a live display.

    Each message starts a stage; the stage in progress has a spinner and a running clock (nvcc
    on a large model takes seconds, so the user sees that something is happening), and each
    finished stage keeps its duration. A failed stage is marked as such before the error shows.
    """

    def __init__(self, console: Console) -> None:
        # The description column gives way (ellipsis) so the clock always shows.
        text = TextColumn("{task.description}",
                          table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1))
        self.progress = Progress(SpinnerColumn(finished_text="[green]✓"), SecondsColumn(), text,
                                 console=console, expand=True)
        self.current: TaskID | None = None

    def __call__(self, message: str) -> None:
        self.finish()
        self.current = self.progress.add_task(message, total=1)

    def finish(self) -> None:
        """Marks the stage in progress done, so that an error after it is not shown as its."""
        if self.current is not None:
            self.progress.update(self.current, completed=1)
            self.current = None

    def __enter__(self) -> StageDisplay:
        self.progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and self.current is not None:
            task = self.progress.tasks[self.current]
            self.progress.update(self.current, description=f"[red]failed:[/red] {task.description}")
            self.progress.stop_task(self.current)
        else:
            self.finish()
        self.progress.stop()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def human_ns(ns: float) -> str:
    return f"{ns / 1e6:.3f} ms" if ns >= 1e5 else f"{ns / 1e3:.1f} us"


def print_summary(artifact: Path, m: dict[str, Any], seconds: float, console: Console) -> None:
    """The facts a user checks after a build: where it went, how big the kernel is, whether
    ptxas spilled, and what the cost model expects per token."""
    k, ptxas, cost = m["kernel"], m["kernel"]["ptxas"], m["cost"]
    spills = ptxas.get("spill_stores", 0)
    table = Table.grid(padding=(0, 2))
    table.add_row("artifact", str(artifact))
    table.add_row("model", f"{m['model']['name']} for {m['target']['name']} "
                           f"({m['target']['arch']}), KV capacity {m['max_seq_len']} positions")
    table.add_row("kernel", f"{k['name']}: {k['ctas']} CTAs x {k['threads']} threads, "
                            f"{human_bytes(k['smem_bytes'])} shared memory each")
    table.add_row("cubin", f"{human_bytes((artifact / 'kernel.cubin').stat().st_size)}, "
                           f"{ptxas.get('registers', '?')} registers/thread, "
                           + (f"[red]{spills} B spilled[/red]" if spills else "no spills")
                           + f", {ptxas.get('stack_bytes', 0)} B stack")
    # the FP8 path, where the compiler chose between tiles and rows (make_program)
    fp8 = [d.removeprefix("[tiling] ") for d in m.get("decisions", [])
           if d.startswith(f"[tiling] {FP8_PATH}")]
    table.add_row("weights", f"{human_bytes(m['weights']['packed_bytes'])} packed"
                  + "".join(f"; {d}" for d in fp8))
    table.add_row("predicted", f"{human_ns(cost['step_ns'])}/token by the cost model "
                               f"(roofline {human_ns(cost['roofline_ns'])}/token)")
    table.add_row("built in", f"{seconds:.1f} s")
    console.print(table)
