"""The lab's tiny assets: every name of :mod:`verl_stable.cpu.assets`, where the CPU launcher builds them.

Kept so that ``verl_stable.lab.assets`` (in the docs, the recipes' comments and callers' scripts) keeps working.
"""

from __future__ import annotations

from verl_stable.cpu.assets import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    MARKER,
    NEWLINE,
    PAD,
    SPECIALS,
    UNK,
    WORDS,
    Assets,
    AssetSpec,
    asset_paths,
    build_datasets,
    build_model,
    build_tokenizer,
    ensure_assets,
)

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "IM_END",
    "IM_START",
    "MARKER",
    "NEWLINE",
    "PAD",
    "SPECIALS",
    "UNK",
    "WORDS",
    "AssetSpec",
    "Assets",
    "asset_paths",
    "build_datasets",
    "build_model",
    "build_tokenizer",
    "ensure_assets",
]
