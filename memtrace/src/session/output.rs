//! Creating the files memtrace writes (recordings, exports) safely: mode 0600 (they name
//! other users' code and addresses), never through a symlink, overwriting only a file of
//! the same kind (a previous recording, an earlier export of the same format) unless
//! `--force`, and under `sudo` handed to the user who ran sudo, so that the commands that
//! read them next need no sudo.
use std::{
    fs::{self, File, OpenOptions},
    io::{self, Read},
    os::{
        fd::AsRawFd as _,
        unix::fs::{MetadataExt as _, OpenOptionsExt},
    },
    path::Path,
};

use anyhow::{Context as _, Result, bail};

use crate::recording::MAGIC;

fn is_recording(path: &Path) -> bool {
    let mut magic = [0u8; 8];
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|()| &magic == MAGIC)
}

/// Creates `path` for writing a recording.
pub fn create(path: &Path, force: bool) -> Result<File> {
    create_replacing(path, force, "a memtrace recording", &is_recording)
}

/// Whether `a` and `b` name the same file (following symlinks).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Creates `path` for writing an export of the recordings `inputs` (the one exported, and
/// the base of a comparison): never one of them (not even with `--force`), and an existing
/// file only if `is_same_kind` says it is an earlier export of the same format (`what`
/// names that kind), or with `--force`.
pub fn create_export(
    path: &Path,
    inputs: &[&Path],
    force: bool,
    what: &str,
    is_same_kind: &dyn Fn(&Path) -> bool,
) -> Result<File> {
    if let Some(input) = inputs.iter().position(|input| same_file(path, input)) {
        let what = if input == 0 { "the recording being exported" } else { "the base recording of the comparison" };
        bail!("{} is {what}; write the export to another file", path.display());
    }
    create_replacing(path, force, what, is_same_kind)
}

/// Under `sudo`, hands a file memtrace created to the user who ran sudo (`SUDO_UID`,
/// `SUDO_GID`); otherwise leaves it to its creator. Best effort: a file that cannot be
/// handed over stays root's.
pub fn hand_to_invoking_user(file: &File) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let id = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<u32>().ok());
    let (Some(uid), Some(gid)) = (id("SUDO_UID"), id("SUDO_GID")) else { return };
    // SAFETY: fchown on a descriptor we own.
    unsafe { libc::fchown(file.as_raw_fd(), uid, gid) };
}

/// Why an existing `path` of type `kind` may not be replaced, if it may not: only a regular
/// file is ever replaced, one that `replaceable` accepts or with `force` (`unlike` says how
/// it differs). A symlink, a device, a FIFO or a socket is never replaced, `--force` or not:
/// as root, `--force -o /dev/null` would have put a file in the device's place.
pub(crate) fn refuse_unless_replaceable(
    path: &Path,
    kind: fs::FileType,
    force: bool,
    unlike: &dyn Fn() -> String,
    replaceable: &dyn Fn() -> bool,
) -> Result<()> {
    if kind.is_file() && (force || replaceable()) {
        return Ok(());
    }
    if kind.is_file() {
        bail!("{} {}; use --force to replace it", path.display(), unlike());
    }
    let what = if kind.is_symlink() { "is a symbolic link" } else { "is not a regular file" };
    bail!("{} {what}: memtrace writes a new regular file only; choose another path", path.display())
}

/// Creates `path` (mode 0600, never through a symlink); an existing file is replaced only
/// if `replaceable` says it is `what`, or with `force`.
fn create_replacing(path: &Path, force: bool, what: &str, replaceable: &dyn Fn(&Path) -> bool) -> Result<File> {
    let noun = what;
    match fs::symlink_metadata(path) {
        Ok(meta) => {
            let kind = meta.file_type();
            if kind.is_dir() {
                bail!("{} is a directory", path.display());
            }
            refuse_unless_replaceable(path, kind, force, &|| format!("exists and is not {noun}"), &|| {
                replaceable(path)
            })?;
            // Unlinking removes a symlink itself, never its target.
            fs::remove_file(path).with_context(|| format!("replacing {}", path.display()))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    // O_EXCL fails if anything (a symlink included) appeared in the meantime.
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    hand_to_invoking_user(&file);
    Ok(file)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt};

    use super::*;

    fn tempdir() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("memtrace-output-").tempdir().unwrap()
    }

    #[test]
    fn creates_private_files_and_replaces_only_recordings() {
        let tmp = tempdir();
        let dir = tmp.path();
        let out = dir.join("memtrace.data");
        drop(create(&out, false).unwrap());
        assert_eq!(fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o600);
        // An empty file is not a recording.
        assert!(create(&out, false).unwrap_err().to_string().contains("not a memtrace recording"));
        fs::write(&out, b"MEMTRACE\x01\x00").unwrap();
        drop(create(&out, false).unwrap());
        fs::write(&out, b"precious").unwrap();
        drop(create(&out, true).unwrap());
        assert_eq!(fs::read(&out).unwrap(), b"");
    }

    #[test]
    fn exports_never_replace_their_recording_nor_foreign_files() {
        let tmp = tempdir();
        let dir = tmp.path();
        let input = dir.join("in.data");
        fs::write(&input, b"MEMTRACE\x01\x00").unwrap();
        let folded = |p: &Path| fs::read(p).is_ok_and(|b| b.ends_with(b" 1\n"));
        // The recording itself, even with --force, and through another name.
        for force in [false, true] {
            let err = create_export(&input, &[&input], force, "a folded export", &folded).unwrap_err().to_string();
            assert!(err.contains("is the recording being exported"), "{err}");
        }
        let alias = dir.join("alias.data");
        std::os::unix::fs::symlink(&input, &alias).unwrap();
        assert!(create_export(&alias, &[&input], true, "a folded export", &folded).is_err());
        assert_eq!(fs::read(&input).unwrap(), b"MEMTRACE\x01\x00");
        // Nor the base of a comparison (`export --diff-base BASE -o BASE --force`).
        let base = dir.join("base.data");
        fs::write(&base, b"MEMTRACE\x01\x00").unwrap();
        let err = create_export(&base, &[&input, &base], true, "a folded export", &folded).unwrap_err().to_string();
        assert!(err.contains("is the base recording of the comparison"), "{err}");
        assert_eq!(fs::read(&base).unwrap(), b"MEMTRACE\x01\x00");
        // A file of another kind only with --force; an earlier export of the same kind.
        let source = dir.join("prog.c");
        fs::write(&source, b"int main(void) { return 0; }\n").unwrap();
        let err = create_export(&source, &[&input], false, "a folded export", &folded).unwrap_err().to_string();
        assert_eq!(err, format!("{} exists and is not a folded export; use --force to replace it", source.display()));
        assert_eq!(fs::read(&source).unwrap(), b"int main(void) { return 0; }\n");
        drop(create_export(&source, &[&input], true, "a folded export", &folded).unwrap());
        let earlier = dir.join("out.folded");
        fs::write(&earlier, b"app;main 1\n").unwrap();
        drop(create_export(&earlier, &[&input], false, "a folded export", &folded).unwrap());
        assert_eq!(fs::read(&earlier).unwrap(), b"");
    }

    #[test]
    fn never_writes_through_a_symlink() {
        let tmp = tempdir();
        let dir = tmp.path();
        let victim = dir.join("victim");
        fs::write(&victim, b"MEMTRACE keep me").unwrap();
        let link = dir.join("memtrace.data");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        // Neither written through nor replaced, --force or not (`-o /dev/stdout` is a link).
        for force in [false, true] {
            let err = create(&link, force).unwrap_err().to_string();
            assert!(err.contains("is a symbolic link") && !err.contains("--force"), "{err}");
        }
        assert_eq!(fs::read(&victim).unwrap(), b"MEMTRACE keep me");
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    }

    /// A device, a FIFO or a socket stays what it is, `--force` or not (as root,
    /// `--force -o /dev/null` replaced the device with a file).
    #[test]
    fn never_replaces_what_is_not_a_regular_file() {
        let tmp = tempdir();
        let dir = tmp.path();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for force in [false, true] {
            let err = create(&fifo, force).unwrap_err().to_string();
            assert!(err.contains("is not a regular file") && !err.contains("--force"), "{err}");
            let err = create_export(&fifo, &[Path::new("/nonexistent.data")], force, "a folded export", &|_| true)
                .unwrap_err()
                .to_string();
            assert!(err.contains("is not a regular file"), "{err}");
        }
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
        let null = Path::new("/dev/null");
        assert!(create(null, true).unwrap_err().to_string().contains("is not a regular file"));
        assert!(fs::metadata(null).unwrap().file_type().is_char_device());
    }
}
