"""The MoE transformer LM and the byte corpus: shapes, causality, aux loss, meta device, data split."""
import math

import pytest
import torch

from moe_proto.data import ByteCorpus, is_heldout
from moe_proto.models import END_OF_DOCUMENT, MoEModelConfig, MoETransformerArgs, MoETransformerLM

TINY = dict(num_layers=2, d_model=32, num_heads=4, ffn_hidden_size=64, max_seq_len=16)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("moe", [dict(num_experts=0), dict(num_experts=4, top_k=2), dict(num_experts=4, num_prototypes=2)])
def test_forward_backward_and_loss_includes_aux(positions, moe):
    torch.manual_seed(0)
    args = MoETransformerArgs(**TINY, positions=positions, moe_every=1, aux_loss_coef=0.5, **moe)
    model = MoETransformerLM(args)
    tokens = torch.randint(0, 257, (3, 16))
    out = model(tokens, tokens)
    assert out.logits.shape == (3, 16, args.vocab_size)
    assert out.loss.item() == pytest.approx(out.ce_loss.item() + 0.5 * out.aux_loss.item(), rel=1e-6)
    assert (out.aux_loss.item() > 0) == bool(moe["num_experts"])
    out.loss.backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0
    assert len(model.moe_layers()) == (2 if moe["num_experts"] else 0)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal_future_tokens_do_not_change_past_logits(positions):
    torch.manual_seed(0)
    model = MoETransformerLM(MoETransformerArgs(**TINY, positions=positions, num_experts=4, dropless=True)).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 7) % 256
    la, lb = model(a).logits, model(b).logits
    torch.testing.assert_close(la[:, :10], lb[:, :10], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_moe_every_places_layers_and_embeddings_are_tied():
    args = MoETransformerArgs(**{**TINY, "num_layers": 6}, num_experts=4, moe_every=3)
    model = MoETransformerLM(args)
    assert [b.is_moe for b in model.blocks] == [False, False, True, False, False, True]
    assert "lm_head" not in dict(model.named_parameters())  # output layer reuses embed.weight


def test_meta_device_builds_large_shapes_without_memory():
    args = MoETransformerArgs(num_layers=24, d_model=1024, num_heads=16, ffn_hidden_size=4096,
                              expert_ffn_hidden_size=21248, num_experts=960, moe_every=1, max_seq_len=512)
    with torch.device("meta"):
        model = MoETransformerLM(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 1e12


def test_config_block_validates_and_feeds_args():
    cfg = MoEModelConfig.model_validate({"num_layers": 2, "d_model": 32, "num_heads": 4, "ffn_hidden_size": 64})
    assert MoETransformerArgs.from_configs(cfg).num_experts == 0
    with pytest.raises(ValueError, match="divisible"):
        MoEModelConfig.model_validate({"num_layers": 2, "d_model": 30, "num_heads": 4, "ffn_hidden_size": 64})
    with pytest.raises(ValueError):
        MoEModelConfig.model_validate({"num_layers": 2, "d_model": 32, "num_heads": 4, "ffn_hidden_size": 64,
                                       "optimiser": "adam"})


def _folder(tmp_path, n=20):
    for i in range(n):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i} " * (50 + i))
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    return tmp_path


def test_corpus_split_is_deterministic_and_skips_binary(tmp_path):
    folder = _folder(tmp_path)
    a = ByteCorpus.from_folder(folder, heldout_fraction=0.2)
    b = ByteCorpus.from_folder(folder, heldout_fraction=0.2)
    assert a.heldout_files == b.heldout_files and a.heldout_files and a.train_files
    assert "blob.bin" not in a.train_files + a.heldout_files
    assert set(a.heldout_files) == {f for f in a.train_files + a.heldout_files if is_heldout(f, 0.2)}
    assert int((a.train == END_OF_DOCUMENT).sum()) == len(a.train_files)


def test_train_batches_shard_by_rank_and_resume(tmp_path):
    corpus = ByteCorpus.from_folder(_folder(tmp_path), heldout_fraction=0.2)
    one = corpus.train_batches(8, 2, rank=0, world_size=1, seed=3)
    whole = [next(one)[0] for _ in range(4)]  # micro-batches of 2 rows
    r0 = corpus.train_batches(8, 1, rank=0, world_size=2, seed=3)
    r1 = corpus.train_batches(8, 1, rank=1, world_size=2, seed=3)
    for m in range(4):  # 2 ranks x 1 row cover exactly one single-rank micro-batch of 2 rows
        torch.testing.assert_close(torch.cat([next(r0)[0], next(r1)[0]]), whole[m])
    resumed = corpus.train_batches(8, 2, rank=0, world_size=1, seed=3, start_micro_batch=2)
    torch.testing.assert_close(next(resumed)[0], whole[2])
    tokens, targets = next(corpus.train_batches(8, 2))
    torch.testing.assert_close(tokens[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_batches_cover_heldout_once_with_equal_batch_counts(tmp_path, world):
    corpus = ByteCorpus.from_folder(_folder(tmp_path), heldout_fraction=0.2)
    per_rank = [list(corpus.eval_batches(16, 4, rank=r, world_size=world)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    predicted = sum(int((t != -100).sum()) for batches in per_rank for _, t in batches)
    assert predicted == corpus.heldout.numel() - 1
