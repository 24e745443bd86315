"""The probe's prompts: a built-in small set, or verl's RL parquet format as ``data.train_files`` reads it.

verl's format: one row per prompt, the chat under ``data.prompt_key`` (default ``prompt``) as a list of
``{"role": ..., "content": ...}`` messages (what :func:`verl_stable.toy.tasks.to_verl_row` writes). verl's agent loop
renders it with the model's chat template and the generation prompt (``add_generation_prompt=True``) through its
Continuous Token builder for the model type; :func:`render_prompt` calls that builder when verl is importable and the
tokenizer's own chat template otherwise (the same ids for a text model: the builder renders with that template).

Which prompt each sample uses (:func:`sample_prompts`): sample ``s`` takes prompt ``(s // per_prompt) mod P``, so
``per_prompt`` consecutive samples share a prompt, as verl's ``rollout.n`` samples of one prompt do, and the first
prompts of the file come first (verl's first batch with ``data.shuffle=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_stable.probe.checks import ProbeInputError

__all__ = [
    "BUILTIN_PROMPTS",
    "builtin_chats",
    "load_tokenizer",
    "prompt_set",
    "read_chats",
    "render_prompt",
    "sample_prompts",
]

Chat = list[dict[str, str]]

BUILTIN_PROMPTS: tuple[str, ...] = (
    "What is 17 times 23? Show your steps.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Solve for x: 3x + 7 = 22.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, how are you?' into French.",
    "A train travels 120 km in 1.5 hours. What is its average speed?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is the derivative of x^3 * sin(x)?",
    "Write a haiku about autumn leaves.",
    "How many edges does a cube have? Explain.",
    "Give a short proof that the square root of 2 is irrational.",
    "Write a SQL query that counts the rows of a table named orders per customer.",
    "If a shirt costs $25 after a 20% discount, what was the original price?",
    "Name the planets of the solar system in order from the sun.",
    "Describe what a hash map is and when to use one.",
)
"""Short single-turn prompts of the kinds RL data holds (arithmetic, code, reasoning, chat)."""


def builtin_chats() -> list[Chat]:
    """:data:`BUILTIN_PROMPTS` as one-message user chats."""
    return [[{"role": "user", "content": text}] for text in BUILTIN_PROMPTS]


def _as_chat(value: Any, where: str) -> Chat:
    """One cell of the prompt column as a chat, or a :class:`ProbeInputError` saying what it holds instead."""
    expected = "a chat: a list of {'role': ..., 'content': ...} messages, as verl's data.train_files holds"
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise ProbeInputError(f"{where} holds a {type(value).__name__}; expected {expected}")
    messages = list(value)
    if not messages:
        raise ProbeInputError(f"{where} is an empty chat; expected {expected}")
    for message in messages:
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise ProbeInputError(f"{where} holds a message {str(message)[:80]!r}; expected {expected}")
    return [{"role": str(m["role"]), "content": m["content"]} for m in messages]


def read_chats(path: str | Path, prompt_key: str = "prompt") -> list[Chat]:
    """The chats of a verl RL parquet file, in file order.

    Raises:
        ProbeInputError: the file is missing or not parquet, has no ``prompt_key`` column or no rows, or a cell is not
            a chat.
    """
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise ProbeInputError(f"--data {path}: no such file; expected a verl RL parquet file (data.train_files)")
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors vary by what the file is; the verdict is one line
        raise ProbeInputError(f"--data {path}: not a parquet file ({type(exc).__name__}: {exc})") from None
    if prompt_key not in frame.columns:
        columns = ", ".join(map(str, frame.columns)) or "none"
        raise ProbeInputError(
            f"--data {path} has no column {prompt_key!r} (its columns: {columns}); pass the prompt column as "
            "--prompt-key (verl's data.prompt_key)"
        )
    if len(frame) == 0:
        raise ProbeInputError(f"--data {path} has no rows")
    return [
        _as_chat(value, f"--data {path}, row {i}, column {prompt_key!r},") for i, value in enumerate(frame[prompt_key])
    ]


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer (verl reads model and tokenizer from one path).

    Raises:
        ProbeInputError: there is none, or it has no chat template (verl renders prompts with it).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # noqa: BLE001 - transformers raises several types for a missing tokenizer
        first = " ".join(str(exc).split())[:200]
        raise ProbeInputError(
            f"--model {model_dir}: no tokenizer could be loaded ({type(exc).__name__}: {first}); verl reads the "
            "tokenizer from the model path"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise ProbeInputError(
            f"--model {model_dir}: the tokenizer has no chat template; verl renders every prompt with it"
        )
    return tokenizer


def _ids(rendered: Any) -> list[int]:
    """Token ids from whatever a chat-template call returned (a list, a BatchEncoding, a tensor)."""
    if hasattr(rendered, "keys") and "input_ids" in rendered.keys():
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    if rendered and isinstance(rendered[0], list):
        rendered = rendered[0]
    return [int(t) for t in rendered]


def render_prompt(tokenizer: Any, chat: Chat, model_type: str | None = None) -> list[int]:
    """The prompt ids verl's agent loop sends the rollout for ``chat`` (see the module docstring).

    Raises:
        ProbeInputError: the template cannot render the chat (a role it does not know ...), or renders nothing.
    """
    try:
        try:
            from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
        except ImportError:  # no verl: the tokenizer's template, which verl's text builders render with
            ids = _ids(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
        else:
            builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type)
            ids = _ids(builder.build_initial_tokens(chat))
    except ProbeInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is the user's data or template: one line
        raise ProbeInputError(
            f"the chat template cannot render {str(chat)[:120]}: {type(exc).__name__}: {exc}"
        ) from None
    if not ids:
        raise ProbeInputError(f"the chat template renders {str(chat)[:120]} as no tokens")
    return ids


def sample_prompts(num_prompts: int, samples: int, per_prompt: int) -> list[int]:
    """The prompt index of each sample: ``(s // per_prompt) mod num_prompts`` for ``s < samples``.

    Raises:
        ValueError: a count below 1.
    """
    for name, value in (("num_prompts", num_prompts), ("samples", samples), ("per_prompt", per_prompt)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return [(s // per_prompt) % num_prompts for s in range(samples)]


def prompt_set(
    tokenizer: Any, chats: Sequence[Chat], indices: Sequence[int], model_type: str | None
) -> dict[int, list[int]]:
    """The rendered ids of every prompt some sample uses, by prompt index (each rendered once)."""
    return {i: render_prompt(tokenizer, chats[i], model_type) for i in sorted(set(indices))}
