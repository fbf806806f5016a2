"""Host side of `tilertc run`: tokenizer, incremental detokenization, Ctrl-C, timing.

Nothing here needs a GPU: the engine is only seen through the token iterator it yields and
its `stop` method, so these pieces are tested on the CPU with a stand-in.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_dir(weights: str | Path | None) -> Path | None:
    """Where a tokenizer for `weights` lives: the weights directory (or a weights file's
    directory) when it holds tokenizer files, as a Hugging Face snapshot does; else None."""
    if weights is None:
        return None
    path = Path(weights)
    folder = path if path.is_dir() else path.parent
    return folder if any((folder / f).is_file() for f in TOKENIZER_FILES) else None


def load_tokenizer(folder: Path) -> Any:
    """The Hugging Face tokenizer in `folder`; transformers is imported only here, because it
    is an optional dependency that token-id runs do not need."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise RuntimeError(f"{folder} holds a tokenizer, but transformers is not installed: "
                           "pip install 'tilertc[hf]' (or pass --prompt-ids)") from None
    return AutoTokenizer.from_pretrained(str(folder))


def parse_ids(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3]."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


class TextStream:
    """Token ids in, printable text pieces out, as tokens arrive.

    Decoding tokens one at a time would split multi-byte characters and lose the spaces that
    tokenizers attach to a neighbouring token, so the prompt and the output are decoded
    together each time and only the new suffix is returned; a trailing U+FFFD (a character
    still incomplete) is held back until the next token completes it. `prompt_text` is the
    decoded prompt, the text the pieces continue.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prompt_text = self._decode()
        self.emitted = len(self.prompt_text)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        piece, self.emitted = text[self.emitted:], len(text)
        return piece


@contextmanager
def stop_on_interrupt(stop: Callable[[], None]) -> Iterator[list[bool]]:
    """While the block runs, Ctrl-C calls `stop` (the kernel ends after the token in flight,
    and the tokens made so far are still printed and counted) instead of raising; a second
    Ctrl-C raises KeyboardInterrupt as usual. Yields a list that is non-empty once stopped."""
    interrupted: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(True)
        stop()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass(frozen=True)
class DecodeStats:
    tokens: int
    first_token_s: float  # prefill, launch and the first decode step
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        """Decode rate of one user: tokens after the first over the time after the first,
        so that prefill does not count against the kernel."""
        if self.tokens > 1 and self.total_s > self.first_token_s:
            return (self.tokens - 1) / (self.total_s - self.first_token_s)
        return self.tokens / self.total_s if self.total_s > 0 else 0.0


def timed_stream(tokens: Iterable[int], emit: Callable[[int], None]) -> DecodeStats:
    """Hand each token to `emit` as it arrives; time the first and the last."""
    start = time.perf_counter()
    first, count = 0.0, 0
    for token in tokens:
        if count == 0:
            first = time.perf_counter() - start
        count += 1
        emit(token)
    return DecodeStats(count, first, time.perf_counter() - start)
