//! A hasher for maps keyed by addresses in the process (a registration's
//! range, a CQ's `ibv_cq`, an `rdma_cm_id`): a few multiplications instead of
//! SipHash's rounds. No peer chooses these keys; at worst (keys the
//! application picks to collide, as a `RegCache` user could) an operation
//! costs time linear in the map's size, never more.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-xorshift hasher over the key's words.
#[derive(Default)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn finish(&self) -> u64 {
        // A product's bit k depends only on the key's bits up to k, and the
        // map indexes by the low bits: bits 44 and up, which depend on every
        // bit a user-space address can differ in, are rotated down there.
        self.0.rotate_left(20)
    }
}

/// A `HashMap` hashed with [`AddrHasher`].
pub(crate) type AddrMap<K, V> = HashMap<K, V, BuildHasherDefault<AddrHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn hashes_spread_over_neighbouring_addresses() {
        let b = BuildHasherDefault::<AddrHasher>::default();
        let strides = [4096usize, 64, 8, 1 << 21, 1 << 30, 1 << 36, 1 << 40];
        for (stride, words) in strides.iter().flat_map(|&s| [(s, 3), (s, 1)]) {
            let mut seen = std::collections::HashSet::new();
            for i in 0..4096usize {
                let addr = 0x7f00_0000_0000 + i * stride;
                let h = if words == 3 {
                    b.hash_one((addr, 4096usize, 1u32))
                } else {
                    b.hash_one(addr)
                };
                seen.insert(h & 0xfff);
            }
            // 4096 buckets, 4096 keys: a good spread fills well over half.
            assert!(seen.len() > 2000, "stride {stride}: {}", seen.len());
        }
    }
}
