//! mimalloc 2.0.9 (include/mimalloc-types.h, src/page-queue.c, segment.c, os.c at v2.0.9),
//! release build (MI_DEBUG 0, no MI_PADDING, MI_SECURE 0), x86_64 (MI_ALIGN2W), 4 KiB OS
//! pages. Blocks from malloc/calloc/realloc/new only: an aligned block's usable size depends
//! on the heap's state and is not a function of the request.
pub const MEDIUM_OBJ_SIZE_MAX: u64 = 128 << 10;
pub const LARGE_OBJ_SIZE_MAX: u64 = 16 << 20;
const SLICE: u64 = 64 << 10;
const MEDIUM_PAGE: u64 = 512 << 10;

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// `mi_bin` for sizes up to `MEDIUM_OBJ_SIZE_MAX`.
fn bin(size: u64) -> u32 {
    let wsize = size.div_ceil(8);
    if wsize <= 1 {
        1
    } else if wsize <= 8 {
        ((wsize + 1) & !1) as u32
    } else {
        let w = wsize - 1;
        let b = 63 - w.leading_zeros();
        ((b << 2) + ((w >> (b - 2)) & 3) as u32) - 3
    }
}

/// `_mi_bin_size`: the block size of a bin.
fn bin_size(bin: u32) -> u64 {
    let words = if bin <= 8 {
        u64::from(bin)
    } else {
        let b = (bin + 3) >> 2;
        let m = u64::from((bin + 3) & 3);
        (5 + m) << (b - 2)
    };
    words * 8
}

/// `_mi_os_good_alloc_size`.
fn os_good_alloc_size(size: u64) -> u64 {
    let a = if size < (512 << 10) {
        4096
    } else if size < (2 << 20) {
        64 << 10
    } else if size < (8 << 20) {
        256 << 10
    } else if size < (32 << 20) {
        1 << 20
    } else {
        4 << 20
    };
    align_up(size, a)
}

/// `mi_usable_size` of a block from malloc/calloc/new/realloc-that-moved.
pub fn usable(size: u64) -> u64 {
    if size <= MEDIUM_OBJ_SIZE_MAX {
        return bin_size(bin(size));
    }
    let block = os_good_alloc_size(size);
    if block <= LARGE_OBJ_SIZE_MAX {
        // a large page of one block filling its 64 KiB slices (512 KiB past 512 KiB)
        align_up(block, if block > MEDIUM_PAGE { MEDIUM_PAGE } else { SLICE })
    } else {
        align_up(block, SLICE) // huge: a segment of its own
    }
}

/// realloc(p, new) where p's usable size was `old`: kept in place when old/2 <= new <= old.
pub fn realloc_usable(old: u64, new: u64) -> u64 {
    if new <= old && new >= old / 2 && new > 0 { old } else { usable(new) }
}
