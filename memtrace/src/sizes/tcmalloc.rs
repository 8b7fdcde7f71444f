//! gperftools 2.10 tcmalloc (src/common.h, common.cc, tcmalloc.cc at gperftools-2.10),
//! Debian's build: 8 KiB pages (kPageShift 13), kMinAlign 16, kMaxSize 256 KiB. The class
//! table depends on `TCMALLOC_TRANSFER_NUM_OBJ` in the program's environment (default 32).
pub const PAGE_SHIFT: u32 = 13;
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
pub const MAX_SIZE: u64 = 256 * 1024;
const ALIGNMENT: u64 = 8;
const MIN_ALIGN: u64 = 16;
pub const DEFAULT_TRANSFER_NUM_OBJ: i64 = 32;

fn alignment_for_size(size: u64) -> u64 {
    let a = if size > MAX_SIZE {
        PAGE_SIZE
    } else if size >= 128 {
        (1u64 << (63 - size.leading_zeros())) / 8
    } else if size >= MIN_ALIGN {
        MIN_ALIGN
    } else {
        ALIGNMENT
    };
    a.min(PAGE_SIZE)
}

fn num_move_size(size: u64, transfer_num_objects: i64) -> i64 {
    let num = ((64.0 * 1024.0 / size as f64) as i64).max(2);
    num.min(transfer_num_objects)
}

/// `SizeMap::Init`: the class sizes in order (85 for the defaults).
pub fn class_sizes(transfer_num_objects: i64) -> Vec<u64> {
    let mut sizes: Vec<u64> = Vec::new();
    let mut pages: Vec<u64> = Vec::new();
    let mut size = ALIGNMENT;
    while size <= MAX_SIZE {
        let alignment = alignment_for_size(size);
        let blocks_to_move = num_move_size(size, transfer_num_objects) / 4;
        let mut psize = 0u64;
        loop {
            psize += PAGE_SIZE;
            while psize % size > psize >> 3 {
                psize += PAGE_SIZE;
            }
            if (psize / size) as i64 >= blocks_to_move {
                break;
            }
        }
        let my_pages = psize >> PAGE_SHIFT;
        if let (Some(&prev_pages), Some(last)) = (pages.last(), sizes.last_mut())
            && my_pages == prev_pages
            && (my_pages << PAGE_SHIFT) / size == (prev_pages << PAGE_SHIFT) / *last
        {
            *last = size; // merged into the previous class
            size += alignment;
            continue;
        }
        sizes.push(size);
        pages.push(my_pages);
        size += alignment;
    }
    sizes
}

fn pages(bytes: u64) -> u64 {
    (bytes >> PAGE_SHIFT) + u64::from(bytes & (PAGE_SIZE - 1) != 0)
}

/// `tc_malloc_size` of the block malloc (`alignment` 0) or memalign (`alignment` > 0)
/// returns for `size` bytes.
pub fn usable(classes: &[u64], size: u64, alignment: u64) -> u64 {
    let align = alignment.max(1);
    if align <= PAGE_SIZE {
        // align_size_up: size 0 becomes `align` (only on the aligned paths)
        let s = if size == 0 && alignment > 0 { align } else { (size + align - 1) & !(align - 1) };
        if s <= MAX_SIZE {
            let i = classes.partition_point(|&c| c < s);
            if let Some(&class) = classes.get(i) {
                return class.max(classes[0]);
            }
        }
    }
    // do_memalign_pages turns size 0 into 1
    let size = if align > PAGE_SIZE { size.max(1) } else { size };
    pages(size) << PAGE_SHIFT
}

/// realloc(p, new) where p's usable size was `old`: the usable size of the result.
pub fn realloc_usable(classes: &[u64], old: u64, new: u64) -> u64 {
    if new > old || new < old / 2 {
        let grow_to = old + old / 4;
        if new > old && new < grow_to { usable(classes, grow_to, 0) } else { usable(classes, new, 0) }
    } else {
        old
    }
}
