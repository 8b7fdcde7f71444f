//! Sampled recordings: how many allocations one sampled allocation stands for.

/// How many allocations one sampled allocation of `size` bytes stands for, when each byte
/// was sampled with probability 1/`mean`: 1/P(sampled) = 1/(1 − e^(−size/mean)), rounded
/// up or down at random (seeded by `seed`, so reports are reproducible) so that the sum
/// stays an unbiased estimate.
pub fn sample_multiplicity(size: u64, mean: u64, seed: u64) -> u64 {
    let p = -(-(size.max(1) as f64) / mean.max(1) as f64).exp_m1();
    let w = 1.0 / p;
    let whole = w.floor();
    // splitmix64 of the seed, as a uniform number in [0, 1).
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let u = (z >> 11) as f64 / (1u64 << 53) as f64;
    whole as u64 + u64::from(u < w - whole)
}
