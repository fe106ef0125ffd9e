"""The expected values and known slips of every numbered exercise, one file per lesson;
importing this package fills :data:`refmath.lessons.table.EXERCISES`."""
from refmath.lessons.expected import (  # noqa: F401  (each file registers its exercises)
    lesson01_attention,
    lesson02_normalisation,
    lesson03_flash_and_kv_cache,
    lesson04_ffn_and_positions,
    lesson05_losses_and_optimisers,
    lesson06_encoder_decoder,
    lesson07_gpt,
    lesson08_modern_decoder_and_gqa,
    lesson09_numerics_and_sampling,
    lesson10_decode_cost,
    lesson11_latent_attention_and_memory,
    lesson12_from_equation_to_kernel,
    lesson13_real_weights,
    lesson14_synthesis,
    lesson15_mixture_of_experts,
    lesson16_capstone,
)
