//! The absolute path of an open file (`struct file`), walked up its dentries and the mounts
//! they sit on to the root of the mount tree, as the kernel's `d_path` does: the names exec
//! and `openat` are given may be relative to a working directory userspace cannot read by
//! the time it reads the record (a short program exec'd as `./prog` under `record -a` is
//! gone by then, and its frames stayed `[unknown]`). The path is built in this CPU's
//! [`PATH_WALK`] buffer: the names' pointers first, innermost first, then the names, root
//! first. Paths of `FILENAME_LEN` bytes or more, deeper than [`PATH_PARTS`], or whose walk
//! meets a dentry cut off from its mount are not built.
use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::helpers::generated;
use memtrace_common::FILENAME_LEN;

use crate::{
    context::read_kernel_at,
    maps::{PATH_PARTS, PATH_WALK, PathWalk},
};

/// `bpf_loop` steps going up: a name each, and a step for each mount crossed.
const UP_STEPS: u32 = 2 * PATH_PARTS as u32;

/// This CPU's buffer.
#[inline(always)]
fn buffer() -> Option<&'static mut PathWalk> {
    // SAFETY: this CPU's value, in a map that lives while programs run. The programs that
    // build paths (exec, `mmap`'s return) are tracepoint programs of a task's syscall,
    // which run with preemption off and never in an interrupt: they do not interleave.
    PATH_WALK.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

/// The walk up: where it is, the names noted, and whether it reached the root.
#[repr(C)]
struct Up {
    dentry: u64,
    vfsmnt: u64,
    n: u32,
    whole: u32,
}

#[inline(never)]
extern "C" fn up_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Up on the caller's stack.
    let up = unsafe { &mut *(state as *mut Up) };
    match try_up(up) {
        Some(true) => 0,
        _ => 1,
    }
}

/// One step up: to the mount point of a mount's root, or to the parent of a dentry,
/// noting its name. Some(false) at the root of the mount tree.
#[inline(always)]
fn try_up(up: &mut Up) -> Option<bool> {
    let root: u64 = read_kernel_at(up.vfsmnt, config!(kernel.vfsmount_root))?;
    if up.dentry == root {
        let mount = up.vfsmnt.wrapping_sub(u64::from(config!(kernel.mount_mnt)));
        let parent: u64 = read_kernel_at(mount, config!(kernel.mount_parent))?;
        if parent == mount {
            up.whole = 1;
            return Some(false);
        }
        up.dentry = read_kernel_at(mount, config!(kernel.mount_mountpoint))?;
        up.vfsmnt = parent.wrapping_add(u64::from(config!(kernel.mount_mnt)));
        return Some(true);
    }
    let parent: u64 = read_kernel_at(up.dentry, config!(kernel.dentry_parent))?;
    if parent == up.dentry || parent == 0 {
        return None; // the root of a file system, but not of its mount: cut off
    }
    let name: u64 = read_kernel_at(up.dentry, config!(kernel.dentry_name))?;
    if up.n as usize >= PATH_PARTS {
        return None;
    }
    // Masked for the verifier, which does not carry the test above to a copy of the index.
    buffer()?.parts[up.n as usize & (PATH_PARTS - 1)] = name;
    up.n += 1;
    up.dentry = parent;
    Some(true)
}

/// The walk down: the next name to write (counting down) and where.
#[repr(C)]
struct Down {
    left: u32,
    /// Where the path's NUL is so far.
    end: u32,
    ok: u32,
    _pad: u32,
}

#[inline(never)]
extern "C" fn down_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Down on the caller's stack.
    let down = unsafe { &mut *(state as *mut Down) };
    match try_down(down) {
        Some(more) => i64::from(!more),
        None => {
            down.ok = 0;
            1
        }
    }
}

/// Writes `/` and the next name, outermost first.
#[inline(always)]
fn try_down(down: &mut Down) -> Option<bool> {
    if down.left == 0 {
        return Some(false);
    }
    down.left -= 1;
    let w = buffer()?;
    let name = w.parts[down.left as usize & (PATH_PARTS - 1)];
    let end = down.end as usize;
    if end >= FILENAME_LEN - 1 {
        return None;
    }
    *w.buf.get_mut(end)? = b'/';
    // Masked for the verifier (end + 1 < FILENAME_LEN): the read of at most FILENAME_LEN
    // bytes stays in the buffer, twice as long.
    let at = (end + 1) & (FILENAME_LEN - 1);
    // SAFETY: writes at most FILENAME_LEN bytes from `at` < FILENAME_LEN into a buffer of
    // 2 * FILENAME_LEN; the source read is checked and NUL-terminates what it copies.
    let n = unsafe {
        generated::bpf_probe_read_kernel_str(
            w.buf.as_mut_ptr().add(at) as *mut c_void,
            FILENAME_LEN as u32,
            name as *const c_void,
        )
    };
    if n <= 1 {
        return None; // unreadable, or an empty name
    }
    down.end = (at + n as usize - 1) as u32;
    Some(true)
}

/// Builds the absolute path of `file` at the start of this CPU's buffer ([`path_buffer`]);
/// returns its length (0: not built). A global BPF function: checked once, on its own.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_file_path(file: u64) -> u64 {
    if config!(kernel.dentry_parent) == 0 || file == 0 {
        return 0;
    }
    let (Some(dentry), Some(vfsmnt)) = (
        read_kernel_at::<u64>(file, config!(kernel.file_path_dentry)),
        read_kernel_at::<u64>(file, config!(kernel.file_path_mnt)),
    ) else {
        return 0;
    };
    // A file deleted: its name now names another file, or none (`d_path` says
    // "(deleted)"). Not so a root, which is never hashed.
    let (Some(parent), Some(pprev)) = (
        read_kernel_at::<u64>(dentry, config!(kernel.dentry_parent)),
        read_kernel_at::<u64>(dentry, config!(kernel.dentry_hash_pprev)),
    ) else {
        return 0;
    };
    if pprev == 0 && parent != dentry {
        return 0;
    }
    let mut up = Up { dentry, vfsmnt, n: 0, whole: 0 };
    // SAFETY: up_step is a BPF callback taking (index, ctx); ctx is the Up on our stack.
    unsafe { generated::bpf_loop(UP_STEPS, up_step as *mut c_void, addr_of_mut!(up) as *mut c_void, 0) };
    if up.whole == 0 || up.n == 0 {
        return 0;
    }
    let mut down = Down { left: up.n, end: 0, ok: 1, _pad: 0 };
    // SAFETY: down_step is a BPF callback taking (index, ctx); ctx is the Down on our stack.
    unsafe { generated::bpf_loop(PATH_PARTS as u32, down_step as *mut c_void, addr_of_mut!(down) as *mut c_void, 0) };
    if down.ok == 0 || down.left != 0 || down.end as usize >= FILENAME_LEN {
        return 0;
    }
    u64::from(down.end)
}

/// The path [`memtrace_file_path`] built (its first `FILENAME_LEN` bytes, NUL-terminated).
#[inline(always)]
pub(crate) fn path_buffer() -> Option<*const u8> {
    buffer().map(|w| w.buf.as_ptr())
}

/// Copies a path into a record's array, in one helper call (an assignment became a
/// byte-by-byte memcpy call): `from` is the walk's buffer ([`path_buffer`]) or a map value's
/// `FILENAME_LEN`-byte array, the path NUL-terminated within its first `FILENAME_LEN` bytes.
#[inline(always)]
pub(crate) fn copy_into(to: &mut [u8; FILENAME_LEN], from: *const u8) {
    // SAFETY: `to` is FILENAME_LEN bytes; `from` has FILENAME_LEN readable bytes (see above).
    unsafe {
        generated::bpf_probe_read_kernel(to.as_mut_ptr() as *mut c_void, FILENAME_LEN as u32, from as *const c_void)
    };
}
