"""benchmarks/published_llama3.py's inputs: Table 4's rows, the FLOP count and the
device it prices with (the pricing itself runs in the benchmark, ~4 min)."""

from benchmarks.published_llama3 import PP, TABLE_4, TP, row_cluster


def test_table_4_rows_fill_their_gpus_with_16m_tokens():
    for run in TABLE_4:
        assert TP * run.cp * PP * run.dp == run.gpus
        assert run.global_batch * run.seq_len == 16 * 2**20


def test_flop_count_is_palms_with_full_attention_and_causal_halves_it():
    run = TABLE_4[2]
    full, causal = run.iteration_flops(), run.iteration_flops(causal=True)
    attention = full - causal  # 6 L h s per token: half of PaLM's 12 L h s
    assert attention == 6 * 126 * 16384 * run.seq_len * run.global_batch * run.seq_len
    assert full / causal > 1.3  # at 131,072 tokens attention is most of the difference


def test_row_cluster_takes_measured_compute_and_datasheet_memory_and_links():
    run = TABLE_4[0]
    measured, datasheet = row_cluster(run), row_cluster(run, "datasheet")
    assert measured.num_devices == datasheet.num_devices == run.gpus
    assert measured.device.memory == datasheet.device.memory == 80e9
    assert measured.inter_node == datasheet.inter_node
    assert measured.intra_node == datasheet.intra_node
    assert measured.device.attention_efficiency > 0 == datasheet.device.attention_efficiency
    assert measured.device.flops("bfloat16") < datasheet.device.flops("bfloat16")
