"""bench.grammar on a short run: each engine walks every document (a token it refuses fails the run), and the engine
part's constrained sequences last the measured steps, with the mask's figures derived from the same rounds."""
from __future__ import annotations

import json

from bench import grammar


def test_engines_and_steps_report_their_figures(capsys, smollm2_tokenizer):
    grammar.bench_engines(smollm2_tokenizer, rounds=2)
    steps = grammar.Steps(smollm2_tokenizer, bsz=2, num_steps=3)
    step_s, sample_s = steps.run(True)
    assert 0 < sample_s < step_s
    recs = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    for doc in grammar.DOCS:
        walk = recs[f"mask_and_advance_{doc}_llguidance"]
        assert walk["value"] > 0 and walk["tokens"] == len(smollm2_tokenizer.encode(json.dumps(grammar.DOCS[doc][1]),
                                                                                    add_bos=False))
        assert recs[f"compile_{doc}_llguidance"]["value"] > 0
