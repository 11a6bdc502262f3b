//! Fingerprints of device memory, so that an incremental checkpoint finds the chunks that
//! did not change since its parent image without moving them over PCIe.
//!
//! The GPU computes them (`fingerprint.ptx`, 2 MiB blocks at the GPU's memory bandwidth:
//! 16 GiB in 5.6 ms on an H100, against 314 ms to copy the same over PCIe); hiber hashes
//! the result (4 KiB per block) with blake3 into one fingerprint per chunk, which the
//! manifest keeps beside the chunk's checksum. A chunk whose fingerprint the parent image
//! holds is shared with the parent (a hard link, its checksum checked) instead of copied
//! and written.
//!
//! This module also holds the same function for the host: the reference the kernel is
//! checked against each time hiber loads it (a GPU whose result differs gets no
//! fingerprints, and its chunks are copied and hashed as before), and what CI tests.
//!
//! Strength: within a lane (every 256th word of a block) one changed word always changes
//! the lane's result (the round is a bijection of the word and of the lane); several changed
//! words collide with probability about 2^-64 per lane, and each word is folded into two
//! lanes from different seeds. The fingerprint finds the application's own changes; it is
//! not meant to resist data made to collide with it (the chunk's blake3 still covers what
//! is stored).

/// Bytes per block: the GPU granularity of VMM memory, so every allocation the agent
/// serves (and so every chunk of it) is whole blocks.
pub const BLOCK: usize = 2 << 20;
/// Threads per block, each folding every `THREADS`-th word.
pub const THREADS: u32 = 256;
/// Bytes the kernel writes per block: two 64-bit lanes per thread.
pub const OUT_PER_BLOCK: usize = THREADS as usize * 16;
/// Names the function, so that images of another one never match.
const TAG: &str = "xxh64x2-256";

/// The kernel, for the driver to compile.
pub const PTX: &str = include_str!("fingerprint.ptx");
pub const KERNEL: &str = "hiber_fingerprint";

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const SEED1: u64 = 0x6869_6265_7200_0001;
const SEED2: u64 = 0x6869_6265_7200_0002;

fn round(acc: u64, w: u64) -> u64 {
    acc.wrapping_add(w.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1)
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// What the kernel writes for one block of `BLOCK` bytes, computed on the host.
pub fn block_out(block: &[u8]) -> Vec<u8> {
    assert_eq!(block.len(), BLOCK);
    let word = |i: usize| u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let mut out = Vec::with_capacity(OUT_PER_BLOCK);
    for t in 0..THREADS as usize {
        let (mut a, mut b) = (SEED1, SEED2);
        for i in (t..BLOCK / 8).step_by(THREADS as usize) {
            let w = word(i);
            a = round(a, w);
            b = round(b, w ^ P3);
        }
        out.extend_from_slice(&avalanche(a).to_le_bytes());
        out.extend_from_slice(&avalanche(b).to_le_bytes());
    }
    out
}

/// The fingerprint of `len` bytes of data from what the kernel wrote for its blocks.
pub fn digest(len: u64, out: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(TAG.as_bytes());
    h.update(&len.to_le_bytes());
    h.update(out);
    format!("{TAG}:{}", h.finalize().to_hex())
}

/// The fingerprint of `data` computed on the host; `None` unless it is whole blocks.
pub fn of_bytes(data: &[u8]) -> Option<String> {
    if data.is_empty() || !data.len().is_multiple_of(BLOCK) {
        return None;
    }
    let out: Vec<u8> = data.chunks(BLOCK).flat_map(block_out).collect();
    Some(digest(data.len() as u64, &out))
}

/// The fingerprint of `len` bytes of zeros (`None` unless whole blocks): memory never
/// written, which needs no copy to be saved (most of a pool reserved up front).
pub fn of_zeros(len: usize) -> Option<String> {
    // Asked for every chunk while the application is stopped: each length once.
    static KNOWN: std::sync::Mutex<Vec<(usize, String)>> = std::sync::Mutex::new(Vec::new());
    if len == 0 || !len.is_multiple_of(BLOCK) {
        return None;
    }
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, fp)) = known.iter().find(|(l, _)| *l == len) {
        return Some(fp.clone());
    }
    let fp = digest(len as u64, &block_out(&vec![0u8; BLOCK]).repeat(len / BLOCK));
    known.push((len, fp.clone()));
    Some(fp)
}

/// Whether hiber fingerprints device memory on the GPU (`HIBER_GPU_FINGERPRINT=0` turns
/// it off: chunks are then copied to the host and hashed to find the unchanged ones).
pub fn enabled() -> bool {
    std::env::var("HIBER_GPU_FINGERPRINT").map_or(true, |v| v != "0")
}

/// A block of known, varied content for checking the kernel: every word distinct.
pub fn test_block() -> Vec<u8> {
    (0..BLOCK as u64 / 8).flat_map(|i| avalanche(i.wrapping_mul(P1) ^ SEED2).to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_source_is_the_function_here() {
        // The constants and the shape the PTX states are the ones this module computes with.
        for c in ["0xC2B2AE3D27D4EB4FU", "0x9E3779B185EBCA87U", "0x165667B19E3779F9U", "0x6869626572000001U", "0x6869626572000002U"] {
            assert!(PTX.contains(c), "{c} missing from the PTX");
        }
        assert!(PTX.contains(&format!(".visible .entry {KERNEL}(")));
        assert!(PTX.contains("2097152") && BLOCK == 2097152);
        assert!(PTX.contains("mul.wide.u32 t, r1, 4096;") && OUT_PER_BLOCK == 4096);
        assert!(!PTX.contains('\0'));
    }

    #[test]
    fn one_changed_word_anywhere_changes_the_fingerprint() {
        let base = test_block();
        let fp = of_bytes(&base).unwrap();
        assert_eq!(of_bytes(&base).unwrap(), fp, "deterministic");
        // Words in different lanes, at the ends and in the middle; one bit, or a whole word.
        for (word, xor) in [(0usize, 1u64), (1, 1 << 63), (255, 0xff), (256, 1), (131_071, u64::MAX), (262_143, 1 << 17)] {
            let mut d = base.clone();
            let w = u64::from_le_bytes(d[word * 8..word * 8 + 8].try_into().unwrap()) ^ xor;
            d[word * 8..word * 8 + 8].copy_from_slice(&w.to_le_bytes());
            assert_ne!(of_bytes(&d).unwrap(), fp, "word {word} changed by {xor:#x}");
        }
        // Two words of one lane swapped: order counts.
        let mut d = base.clone();
        let (x, y) = (3 * 8, (3 + 256) * 8);
        let tmp: Vec<u8> = d[x..x + 8].to_vec();
        d.copy_within(y..y + 8, x);
        d[y..y + 8].copy_from_slice(&tmp);
        assert_ne!(of_bytes(&d).unwrap(), fp, "swapped words");
    }

    #[test]
    fn zeros_and_lengths() {
        let zero = vec![0u8; 2 * BLOCK];
        let one = of_bytes(&zero[..BLOCK]).unwrap();
        let two = of_bytes(&zero).unwrap();
        assert_ne!(one, two, "the length is part of the fingerprint");
        assert!(two.starts_with("xxh64x2-256:") && two.len() == TAG.len() + 1 + 64);
        assert_eq!(of_bytes(&zero[..BLOCK - 8]), None, "not whole blocks");
        assert_eq!(of_zeros(2 * BLOCK).unwrap(), two, "zeros known without reading them");
        assert_eq!(of_zeros(BLOCK).unwrap(), one);
        assert_eq!(of_zeros(BLOCK + 8), None);
        let mut almost = zero.clone();
        almost[BLOCK + 5] = 1;
        assert_ne!(of_bytes(&almost).unwrap(), two, "one set byte is not zeros");
        assert_eq!(of_bytes(&[]), None);
        // Blocks are not interchangeable: the same two blocks in the other order differ.
        let t = test_block();
        let ab: Vec<u8> = t.iter().chain(zero[..BLOCK].iter()).copied().collect();
        let ba: Vec<u8> = zero[..BLOCK].iter().chain(t.iter()).copied().collect();
        assert_ne!(of_bytes(&ab), of_bytes(&ba));
    }
}
