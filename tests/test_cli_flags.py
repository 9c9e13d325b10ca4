"""The engine's flags are made from EngineConfig's options (cli/flags.py): every flag the CLI had
before that change still parses, to the same option, and every option has its flag."""

import re
from pathlib import Path

import pytest

from pagedllm.cli.flags import engine_config
from pagedllm.cli.parser import build_parser
from pagedllm.config import EngineConfig, engine_options

HELP = Path(__file__).parent / "data" / "cli-help"  # `pagedllm [COMMAND] --help` before the change
COMMANDS = {
    "top": [],
    "serve": ["serve"],
    "chat": ["chat"],
    "generate": ["generate"],
    "trace": ["trace"],
    "plain": ["plain", "-m", "x"],
    "gguf": ["gguf", "-m", "x", "-f", "y.gguf"],
}


def _parser_of(argv):
    p = build_parser(argv)
    for word in argv:
        subs = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
        if subs and word in subs[0].choices:
            p = subs[0].choices[word]
    return p


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_the_old_help_is_still_accepted(command):
    old = (HELP / f"{command}.txt").read_text()
    # An option's line starts "  -f ARG, --flag ARG" and its help follows after two spaces or more.
    lines = [ln.strip().split("  ")[0] for ln in old.splitlines() if ln.startswith("  -")]
    flags = {f for ln in lines for f in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", ln)}
    parser = _parser_of(COMMANDS[command])
    missing = sorted(f for f in flags if f not in parser._option_string_actions)
    assert len(flags) > 20 and not missing, missing


def test_the_old_spellings_reach_the_same_options():
    argv = [
        "serve",
        "m.gguf",
        "--pa-gpu-mem",
        "64",
        "--pa-blk-size",
        "16",
        "--pa-cache-type",
        "int8",
        "--max-seqs",
        "3",
        "--max-seq-len",
        "512",
        "--no-paged-attn",
        "--no-prefix-cache",
        "-tp",
        "1",
        "--prefix-cache-n",
        "0",
        "--speculative-ngram",
        "4",
        "--enable-lora",
        "--max-loras",
        "2",
    ]
    cfg = engine_config(build_parser(argv).parse_args(argv), model="m.gguf")
    assert (cfg.cache.kv_cache_memory_mb, cfg.cache.block_size, cfg.cache.kv_cache_dtype) == (64.0, 16, "int8")
    assert (cfg.scheduler.max_num_seqs, cfg.load.max_model_len) == (3, 512)
    assert cfg.cache.paged_attention is False and cfg.cache.enable_prefix_caching is False
    assert cfg.speculative.to_dict() == {"method": "ngram", "num_tokens": 4}
    assert (cfg.lora.enable_lora, cfg.lora.max_loras) == (True, 2)


def test_each_option_has_a_flag_named_after_it_and_a_value_given_before_a_subcommand_stays():
    parser = _parser_of(["serve"])
    for o in engine_options():
        if o.cli:
            assert (o.negative if o.type is bool and o.default else o.flag) in parser._option_string_actions
    argv = ["--pa-blk-size", "8", "serve"]
    assert engine_config(build_parser(argv).parse_args(argv)).cache.block_size == 8


def test_a_flag_left_out_keeps_the_options_default_and_the_help_says_it():
    argv = ["serve"]
    assert engine_config(build_parser(argv).parse_args(argv)) == EngineConfig.from_kwargs()
    text = _parser_of(argv).format_help()
    assert "(default: 64)" in text and "(default: 32)" in text


def test_a_misspelt_keyword_names_the_option_meant():
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=4)
