//! Filling the arrays of maps (a ring per CPU, an unwind table per file). The kernel waits
//! for an RCU grace period after every update of an array of maps, 10–15 ms each, so
//! installing rings one by one cost 16 grace periods on a 16-CPU machine and each program
//! start paid one per library table. A batch of updates is issued here on parallel
//! threads, whose waits overlap in the same grace periods.
use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
};

/// `BPF_MAP_UPDATE_ELEM`.
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
/// At most this many updates in flight at once.
const THREADS: usize = 32;

/// The `BPF_MAP_*_ELEM` member of `union bpf_attr`.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// Sets `outer[index] = inner` for one entry.
fn set(outer: BorrowedFd<'_>, index: u32, inner: BorrowedFd<'_>) -> io::Result<()> {
    let value = inner.as_raw_fd() as u32;
    let attr = ElemAttr {
        map_fd: outer.as_raw_fd() as u32,
        _pad: 0,
        key: std::ptr::from_ref(&index) as u64,
        value: std::ptr::from_ref(&value) as u64,
        flags: 0,
    };
    // SAFETY: `attr` is a valid BPF_MAP_UPDATE_ELEM argument whose key and value pointers
    // refer to locals that outlive the call; the kernel only reads them.
    let ret =
        unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_UPDATE_ELEM, std::ptr::from_ref(&attr), size_of::<ElemAttr>()) };
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Sets every `outer[index] = inner` of `entries`, on parallel threads; one result per
/// entry, in order.
pub(super) fn set_all(outer: BorrowedFd<'_>, entries: &[(u32, BorrowedFd<'_>)]) -> Vec<io::Result<()>> {
    if entries.len() <= 1 {
        return entries.iter().map(|&(index, inner)| set(outer, index, inner)).collect();
    }
    let per_thread = entries.len().div_ceil(THREADS);
    std::thread::scope(|scope| {
        let threads: Vec<_> = entries
            .chunks(per_thread)
            .map(|batch| {
                scope.spawn(move || batch.iter().map(|&(index, inner)| set(outer, index, inner)).collect::<Vec<_>>())
            })
            .collect();
        threads
            .into_iter()
            .zip(entries.chunks(per_thread))
            .flat_map(|(thread, batch)| {
                thread
                    .join()
                    .unwrap_or_else(|_| batch.iter().map(|_| Err(io::Error::other("thread panicked"))).collect())
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd as _, FromRawFd as _, OwnedFd};

    use super::*;

    #[test]
    fn a_bad_descriptor_is_an_error_for_its_entry_only() {
        // Not a map: the kernel refuses each update with EBADF or EINVAL, and nothing panics.
        // SAFETY: a fresh descriptor of /dev/null, owned here.
        let file = unsafe { OwnedFd::from_raw_fd(libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY)) };
        let entries: Vec<(u32, BorrowedFd<'_>)> = (0..40).map(|i| (i, file.as_fd())).collect();
        let results = set_all(file.as_fd(), &entries);
        assert_eq!(results.len(), 40);
        assert!(results.iter().all(Result::is_err));
    }
}
