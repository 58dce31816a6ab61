import torch

from picasso_ops.models import FieldEmbeddings, WideAndDeep, WideAndDeepArgs


def _jagged(num_fields, batch, vocab, max_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_fields, batch), generator=g)
    values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
    return values, lengths


def test_field_embeddings_pool_each_field_separately():
    values, lengths = _jagged(3, 5, 7, 3)
    emb = FieldEmbeddings([7, 7, 7], dim=4, pooling="sum", init_std=1.0)
    out = emb(values, lengths)
    assert out.shape == (5, 3, 4)
    pos = 0
    for f in range(3):
        for b in range(5):
            n = int(lengths[f, b])
            expect = emb.bags[f].weight[values[pos:pos + n]].sum(0)
            torch.testing.assert_close(out[b, f], expect)
            pos += n


def test_wide_and_deep_fm_term_matches_pairwise_sum():
    args = WideAndDeepArgs(vocab_sizes=[11] * 4, num_dense=3, embedding_dim=5, hidden=(8,))
    model = WideAndDeep(args)
    for bag in model.embeddings.bags:
        torch.nn.init.normal_(bag.weight)
    values, lengths = _jagged(4, 6, 11, 2, seed=1)
    dense = torch.randn(6, 3)
    emb = model.embeddings(values, lengths)
    pairwise = sum((emb[:, i] * emb[:, j]).sum(-1) for i in range(4) for j in range(i + 1, 4))
    no_fm = WideAndDeep(WideAndDeepArgs(**{**args.__dict__, "fm": False}))
    no_fm.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(dense, values, lengths) - no_fm(dense, values, lengths), pairwise)


def test_wide_and_deep_learns_a_planted_rule():
    torch.manual_seed(0)
    model = WideAndDeep(WideAndDeepArgs(vocab_sizes=[4] * 2, num_dense=1, embedding_dim=4, hidden=(8,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    lengths = torch.ones(2, 64, dtype=torch.long)
    for _ in range(150):
        values = torch.randint(0, 4, (128,))
        labels = (values[:64] == values[64:]).float()  # click iff both fields carry the same id
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.zeros(64, 1), values, lengths), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2
