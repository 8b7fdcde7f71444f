//! jemalloc 5.x size classes (include/jemalloc/internal/sc.h and sz.h at 5.3.0):
//! `SC_LG_NGROUP` = 2 and `SC_LG_TINY_MIN` = 3 are fixed; `LG_QUANTUM` and `LG_PAGE` are
//! build settings (x86_64: 4 and 12, as Debian's libjemalloc2 5.3.0 and the default
//! builds of bundled copies use). Usable size equals `nallocx` and `malloc_usable_size`.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    pub lg_quantum: u32,
    pub lg_page: u32,
}

pub const X86_64: Config = Config { lg_quantum: 4, lg_page: 12 };
/// `SC_LARGE_MAXCLASS` on 64-bit: 2^62 + 3 * 2^60.
pub const LARGE_MAXCLASS: u64 = 0x7000_0000_0000_0000;

impl Config {
    fn page(self) -> u64 {
        1 << self.lg_page
    }

    /// `SC_SMALL_MAXCLASS` = 2^(LG_PAGE+1) + 3 * 2^(LG_PAGE-1): 14336 for 4 KiB pages.
    fn small_maxclass(self) -> u64 {
        (1 << (self.lg_page + 1)) + 3 * (1 << (self.lg_page - 1))
    }

    /// `SC_LARGE_MINCLASS` = 2^(LG_PAGE+2): 16384 for 4 KiB pages.
    fn large_minclass(self) -> u64 {
        1 << (self.lg_page + 2)
    }

    /// `sz_s2u`: the size class of a request; None where jemalloc fails the call.
    pub fn s2u(self, size: u64) -> Option<u64> {
        if size > LARGE_MAXCLASS {
            return None;
        }
        let size = size.max(1);
        let x = 64 - (size - 1).leading_zeros(); // ceil(log2(size))
        if self.lg_quantum > 3 && x < self.lg_quantum {
            return Some(1 << x.max(3)); // tiny classes 8 .. quantum/2
        }
        // Four classes per doubling, spaced 2^(x-3), never closer than the quantum.
        let lg_delta = if x < 2 + self.lg_quantum + 1 { self.lg_quantum } else { x - 3 };
        let mask = (1u64 << lg_delta) - 1;
        Some((size + mask) & !mask)
    }

    /// `sz_sa2u`: the usable size of an aligned request (alignment a power of two).
    pub fn sa2u(self, size: u64, alignment: u64) -> Option<u64> {
        if size <= self.small_maxclass() && alignment <= self.page() {
            let u = self.s2u((size + alignment - 1) & !(alignment - 1))?;
            if u < self.large_minclass() {
                return Some(u);
            }
        }
        if alignment > LARGE_MAXCLASS {
            return None;
        }
        if size <= self.large_minclass() { Some(self.large_minclass()) } else { self.s2u(size) }
    }
}

/// The usable size of a block from an entry point of kind `api` ("malloc", "aligned",
/// "memalign", "x" for mallocx/rallocx), for a request of `size` bytes aligned to
/// `alignment` (0 or 1: none).
pub fn usable(config: Config, api: Api, size: u64, alignment: u64) -> Option<u64> {
    match api {
        Api::Plain => config.s2u(size),
        // posix_memalign, aligned_alloc and aligned new turn size 0 into 1.
        Api::Aligned => config.sa2u(size.max(1), alignment.max(1)),
        // memalign/valloc, and mallocx/rallocx with MALLOCX_ALIGN: no bump of size 0.
        Api::AlignedNoBump if alignment > 1 => config.sa2u(size, alignment),
        Api::AlignedNoBump => config.s2u(size),
    }
}

/// Which size rule an entry point follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// malloc, calloc, realloc, new.
    Plain,
    /// posix_memalign, aligned_alloc.
    Aligned,
    /// memalign, valloc, mallocx, rallocx.
    AlignedNoBump,
}
