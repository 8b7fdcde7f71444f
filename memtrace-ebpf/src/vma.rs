//! What the mapping at an address is, as mmap's rules see it. `mremap` carries no
//! protection and no file: the mapping it moves or resizes is looked up in the process's
//! memory map (`bpf_find_vma`, Linux 5.17, as `bpf_loop` is) and its new mapping recorded
//! as its mmap was: a read-only view of a file not at all (SQLite grows its database's
//! mapping with mremap), an address-space reservation (PROT_NONE) as reserved.
use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::helpers::generated;

use crate::context::read_kernel_at;

/// The mapping at an address, by what memtrace records of it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Vma {
    /// Memory the program uses: anonymous, or a file's pages it may write.
    Memory,
    /// A read-only view of a file in the page cache: not memory allocated.
    FileView,
    /// Address space only (no access): reserved.
    NoAccess,
    /// No mapping there (the call fails): taken as memory.
    Unknown,
    /// The memory map was locked for writing (`bpf_find_vma` only tries its lock): taken
    /// as memory, and counted.
    Busy,
}

/// `bpf_find_vma`'s answer when the memory map's lock was not free.
const EBUSY: i64 = 16;

/// What the callback reads of the mapping: its `vm_flags` and `vm_file`.
#[repr(C)]
struct Found {
    flags: u64,
    file: u64,
    found: u64,
}

const VM_READ: u64 = 0x1;
const VM_WRITE: u64 = 0x2;
const VM_EXEC: u64 = 0x4;

/// The mapping of the current process that holds `addr`.
#[inline(always)]
pub(crate) fn vma_at(addr: u64) -> Vma {
    let mut found = Found { flags: 0, file: 0, found: 0 };
    // SAFETY: the task is the current one (as the helper requires); the callback takes
    // (task, vma, ctx) and ctx is `found`, on this stack for the call's duration.
    let ret = unsafe {
        generated::bpf_find_vma(
            generated::bpf_get_current_task_btf(),
            addr,
            vma_found as *mut c_void,
            addr_of_mut!(found) as *mut c_void,
            0,
        )
    };
    if ret == -EBUSY {
        return Vma::Busy;
    }
    if ret != 0 || found.found == 0 {
        return Vma::Unknown;
    }
    classify(found.flags, found.file != 0)
}

/// mmap's rules on a mapping's flags: a file's mapping the program cannot write is a view
/// (PROT_NONE ones too: ld.so's gaps between a library's segments), else one without
/// access is reserved address space.
#[inline(always)]
fn classify(flags: u64, file: bool) -> Vma {
    if file && flags & VM_WRITE == 0 {
        Vma::FileView
    } else if flags & (VM_READ | VM_WRITE | VM_EXEC) == 0 {
        Vma::NoAccess
    } else {
        Vma::Memory
    }
}

/// `bpf_find_vma`'s callback, run under the memory map's lock with the mapping found.
#[inline(never)]
extern "C" fn vma_found(_task: *mut c_void, vma: *mut c_void, ctx: *mut c_void) -> i64 {
    let vma = vma as u64;
    let flags = read_kernel_at::<u64>(vma, config!(kernel.vma_flags));
    let file = read_kernel_at::<u64>(vma, config!(kernel.vma_file));
    if let (Some(flags), Some(file)) = (flags, file) {
        // SAFETY: ctx is the caller's `Found` (see `vma_at`).
        let found = unsafe { &mut *(ctx as *mut Found) };
        found.flags = flags;
        found.file = file;
        found.found = 1;
    }
    0
}
