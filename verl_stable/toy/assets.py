"""Tiny local assets for CPU runs of verl: tokenizer, Qwen3-MoE model, RL datasets -- all built here, no download.

* Tokenizer: word-level (``tokenizers``), whitespace split, the task words + digits + chat markers, a chat template;
  saved as a Hugging Face tokenizer directory.
* Model: a random ``Qwen3MoeConfig`` model (default 4 layers, 16 experts, top-4) saved with ``save_pretrained``
  into the same directory (verl reads model and tokenizer from one path).
* Data: ``train.parquet`` / ``val.parquet`` in verl's RL format (see :mod:`verl_stable.toy.tasks`).

The CPU launcher (:mod:`verl_stable.toy.launch`) and the lab build them here; :mod:`verl_stable.toy.assets` still offers
every name.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_stable.toy import tasks

PAD, BOS, UNK = "<pad>", "<bos>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
EOS = IM_END  # ChatML: a turn ends with <|im_end|>, which is also the tokenizer's eos
NEWLINE = "\n"  # one token: verl's Qwen continuous-token builder requires it
SPECIALS = (PAD, BOS, UNK, IM_START, IM_END)
WORDS = ("system", "user", "assistant", *tasks.TASK_WORDS, *tasks.DIGITS, ":", "=", "?")
# Qwen's ChatML layout (verl picks its Qwen token builder for qwen3_moe models).
CHAT_TEMPLATE = (
    "{% for message in messages %}" + IM_START + "{{ message['role'] }}\n{{ message['content'] }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
MARKER = "verl_stable_assets.json"


@dataclass(frozen=True)
class AssetSpec:
    """What to build. Changing any field rebuilds the assets."""

    task: str = "copy"
    num_train: int = 256
    num_val: int = 32
    seed: int = 0
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    # The pad token's embedding row drawn like every other row, instead of transformers' zeros (``padding_idx``). The
    # random toy policy emits <pad>; verl's Megatron actor has no padding_idx, so a zero row gets the first RMSNorm's
    # backward at x = 0 (a 1/sqrt(eps) gain), its gradient then dominates the global norm and the norm clip shrinks
    # every other update ~100x. The Megatron runs set it (launch.asset_spec); False keeps the FSDP runs' and the lab's
    # model.
    random_pad_row: bool = False


@dataclass(frozen=True)
class Assets:
    """Where one build of the assets lies: its root, the model (and tokenizer) directory, the parquet files."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path


def build_tokenizer(out_dir: str | os.PathLike) -> object:
    """Build and save the word-level tokenizer with a chat template; returns the HF tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIALS, NEWLINE, *WORDS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    # Added tokens are matched before whitespace splitting, so "\n" survives as its own token.
    core.add_tokens([AddedToken(NEWLINE, normalized=False, special=False)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    return tok


def model_config(spec: AssetSpec, vocab_size: int, **token_ids: int) -> object:
    """The tiny Qwen3-MoE's ``Qwen3MoeConfig`` for ``spec`` (every layer sparse), with the tokenizer's special ids."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        **token_ids,
    )


def build_model(out_dir: str | os.PathLike, spec: AssetSpec, tokenizer: object) -> object:
    """Build a random tiny Qwen3-MoE (every layer sparse) and save it with ``save_pretrained``."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = model_config(
        spec,
        len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=eos_id,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config).float()
    if spec.random_pad_row:
        with torch.no_grad():
            model.model.embed_tokens.weight[config.pad_token_id].normal_(0.0, config.initializer_range)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(str(out_dir))
    return model


def build_datasets(root: str | os.PathLike, spec: AssetSpec) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` for ``spec.task``."""
    import pandas as pd

    root = Path(root)
    paths = []
    for split, n, seed in (("train", spec.num_train, spec.seed), ("val", spec.num_val, spec.seed + 1)):
        rows = [tasks.to_verl_row(ex, split, i) for i, ex in enumerate(tasks.make_examples(spec.task, n, seed))]
        path = root / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]


def _read_marker(marker: Path) -> object:
    """The build record, or None when it is missing or damaged (then the assets are rebuilt)."""
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def asset_paths(root: str | os.PathLike) -> Assets:
    """Where :func:`ensure_assets` puts the assets under ``root``; builds nothing (for checks made before any work)."""
    root = Path(root)
    return Assets(root, root / "model", root / "train.parquet", root / "val.parquet")


def ensure_assets(root: str | os.PathLike, spec: AssetSpec | None = None) -> Assets:
    """Create the assets under ``root`` unless an identical build is already there. Returns their paths."""
    spec = spec or AssetSpec()
    assets = asset_paths(root)
    root, model_dir = assets.root, assets.model_dir
    marker = root / MARKER
    if _read_marker(marker) == asdict(spec) and assets.train_file.exists():
        return assets
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model_dir)
    build_model(model_dir, spec, tokenizer)
    build_datasets(root, spec)
    marker.write_text(json.dumps(asdict(spec), indent=1))
    return assets
