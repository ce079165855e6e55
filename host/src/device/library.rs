//! Loading a device library: dlopen, the entry symbol, and the ABI version, size and entry checks done before any device function runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use libloading::Library;
use plughost_device_abi::abi::{
    AllocFn, CallableCountFn, CallableDeviceNsFn, CallableLaunchesFn, CallableNameFn, CloseFn,
    CopyOutPollFn, CopyOutStartFn, FreeFn, LastErrorFn, LaunchFn, OpenFn, ReadFn, StatsFn,
    SynchronizeFn, WriteFn,
};
use plughost_device_abi::{
    ENTRY_SYMBOL, EntryFn, PLUGHOST_DEVICE_ABI_VERSION, PlughostDeviceHeader, PlughostDeviceV1,
};

use super::error::DeviceError;

/// A loaded device library whose function table passed the checks. Cheap to clone; the
/// library stays loaded while any clone or any [`Device`](super::Device) opened from it lives.
#[derive(Clone)]
pub struct DeviceLibrary {
    path: PathBuf,
    pub(super) loaded: Arc<LoadedLibrary>,
}

pub(super) struct LoadedLibrary {
    pub(super) functions: DeviceFunctions,
    // Dropped last: unloading the library invalidates the function pointers above.
    _library: Library,
}

/// The checked function table: every required entry present.
#[derive(Clone, Copy)]
pub(super) struct DeviceFunctions {
    pub(super) open: OpenFn,
    pub(super) close: CloseFn,
    pub(super) alloc: AllocFn,
    pub(super) free: FreeFn,
    pub(super) write: WriteFn,
    pub(super) read: ReadFn,
    pub(super) callable_count: CallableCountFn,
    pub(super) callable_name: CallableNameFn,
    pub(super) launch: LaunchFn,
    pub(super) synchronize: SynchronizeFn,
    pub(super) stats: StatsFn,
    pub(super) callable_launches: CallableLaunchesFn,
    pub(super) last_error: LastErrorFn,
    /// Absent from a first-revision table, or left null by a device that does not time its
    /// callables.
    pub(super) callable_device_ns: Option<CallableDeviceNsFn>,
    /// Revision 1.2's background copy out, when the table has both entries; without it the
    /// host copies KV blocks out with synchronous reads.
    pub(super) copy_out: Option<(CopyOutStartFn, CopyOutPollFn)>,
}

impl DeviceLibrary {
    /// Loads the library at `path` and checks its function table.
    pub fn load(path: impl AsRef<Path>) -> Result<DeviceLibrary, DeviceError> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(DeviceError::LibraryNotFound {
                path: path.to_path_buf(),
            });
        }
        // A bare file name would make dlopen search the library path instead of this file.
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        // SAFETY: loading runs the library's initializers. Device libraries are native code the
        // deployment chose to trust; nothing here can make that safe.
        let library = unsafe { Library::new(path.as_os_str()) }.map_err(|source| {
            DeviceError::LoadFailed {
                path: path.clone(),
                source,
            }
        })?;
        // SAFETY: the ABI defines the symbol's type as `EntryFn`.
        let entry: EntryFn = unsafe { library.get::<EntryFn>(ENTRY_SYMBOL) }
            .map(|symbol| *symbol)
            .map_err(|source| DeviceError::MissingSymbol {
                path: path.clone(),
                symbol: ENTRY_SYMBOL,
                source,
            })?;
        // SAFETY: the entry point takes no arguments and returns a pointer to a static table.
        let table = unsafe { entry() };
        // SAFETY: the table is static in the library, which stays loaded in `LoadedLibrary`.
        let functions = unsafe { check_table(&path, table) }?;
        Ok(DeviceLibrary {
            path,
            loaded: Arc::new(LoadedLibrary {
                functions,
                _library: library,
            }),
        })
    }

    /// The absolute path the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads the version header first, then the table, so a table of another ABI version is
/// refused without touching any of its other fields.
///
/// # Safety
/// `table` is null or points to a readable table that starts with a [`PlughostDeviceHeader`]
/// and is at least `struct_size` bytes long.
unsafe fn check_table(
    path: &Path,
    table: *const PlughostDeviceV1,
) -> Result<DeviceFunctions, DeviceError> {
    if table.is_null() {
        return Err(DeviceError::NullTable {
            path: path.to_path_buf(),
            symbol: ENTRY_SYMBOL,
        });
    }
    // SAFETY: every table version starts with the header.
    let header = unsafe { table.cast::<PlughostDeviceHeader>().read() };
    if header.abi_version != PLUGHOST_DEVICE_ABI_VERSION {
        return Err(DeviceError::AbiVersionMismatch {
            path: path.to_path_buf(),
            found: header.abi_version,
            expected: PLUGHOST_DEVICE_ABI_VERSION,
        });
    }
    // Larger is fine: a later minor revision may append entries this host does not use.
    // Smaller down to the first revision's table is fine too: the entries it lacks read as null.
    if header.struct_size < PlughostDeviceV1::MIN_SIZE {
        return Err(DeviceError::TableTooSmall {
            path: path.to_path_buf(),
            found: header.struct_size,
            expected: PlughostDeviceV1::MIN_SIZE,
        });
    }
    let readable = header.struct_size.min(PlughostDeviceV1::SIZE) as usize;
    let mut copy = std::mem::MaybeUninit::<PlughostDeviceV1>::zeroed();
    // SAFETY: the header promises `struct_size` readable bytes, and `copy` has room for
    // `SIZE`; every field of the table is an integer or an `Option` of a function pointer, for
    // which all-zero bytes are valid (0 and `None`), so the bytes not copied leave it valid.
    let table = unsafe {
        std::ptr::copy_nonoverlapping(table.cast::<u8>(), copy.as_mut_ptr().cast::<u8>(), readable);
        copy.assume_init()
    };
    let require = |entry: &'static str| DeviceError::NullEntry {
        path: path.to_path_buf(),
        entry,
    };
    Ok(DeviceFunctions {
        open: table.open.ok_or_else(|| require("open"))?,
        close: table.close.ok_or_else(|| require("close"))?,
        alloc: table.alloc.ok_or_else(|| require("alloc"))?,
        free: table.free.ok_or_else(|| require("free"))?,
        write: table.write.ok_or_else(|| require("write"))?,
        read: table.read.ok_or_else(|| require("read"))?,
        callable_count: table
            .callable_count
            .ok_or_else(|| require("callable_count"))?,
        callable_name: table
            .callable_name
            .ok_or_else(|| require("callable_name"))?,
        launch: table.launch.ok_or_else(|| require("launch"))?,
        synchronize: table.synchronize.ok_or_else(|| require("synchronize"))?,
        stats: table.stats.ok_or_else(|| require("stats"))?,
        callable_launches: table
            .callable_launches
            .ok_or_else(|| require("callable_launches"))?,
        last_error: table.last_error.ok_or_else(|| require("last_error"))?,
        callable_device_ns: table.callable_device_ns,
        copy_out: table.copy_out_start.zip(table.copy_out_poll),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY_TABLE: PlughostDeviceV1 = PlughostDeviceV1 {
        abi_version: PLUGHOST_DEVICE_ABI_VERSION,
        struct_size: PlughostDeviceV1::SIZE,
        open: None,
        close: None,
        alloc: None,
        free: None,
        write: None,
        read: None,
        callable_count: None,
        callable_name: None,
        launch: None,
        synchronize: None,
        stats: None,
        callable_launches: None,
        last_error: None,
        callable_device_ns: None,
        copy_out_start: None,
        copy_out_poll: None,
    };

    fn check(table: &PlughostDeviceV1) -> String {
        // SAFETY: a reference to a whole table: readable for its full size, whatever its
        // header claims.
        match unsafe { check_table(Path::new("/x/libdev.so"), table) } {
            Ok(_) => "ok".to_string(),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn tables_are_checked_in_order() {
        let cases = [
            (
                PlughostDeviceV1 {
                    abi_version: 7,
                    struct_size: 8,
                    ..EMPTY_TABLE
                },
                "device library `/x/libdev.so` speaks device ABI 7; this host speaks 1".to_string(),
            ),
            (
                PlughostDeviceV1 {
                    struct_size: 16,
                    ..EMPTY_TABLE
                },
                format!(
                    "declares a function table of 16 bytes, host expects at least {}",
                    PlughostDeviceV1::MIN_SIZE
                ),
            ),
            (
                EMPTY_TABLE,
                "leaves function table entry `open` null".to_string(),
            ),
            // A first-revision table, without `callable_device_ns`, passes the size check.
            (
                PlughostDeviceV1 {
                    struct_size: PlughostDeviceV1::MIN_SIZE,
                    ..EMPTY_TABLE
                },
                "leaves function table entry `open` null".to_string(),
            ),
        ];
        for (table, expected) in cases {
            let message = check(&table);
            assert!(message.contains(&expected), "{message}");
        }
        // SAFETY: a null table is allowed and refused before any read.
        let message = unsafe { check_table(Path::new("/x/libdev.so"), std::ptr::null()) }
            .err()
            .map(|error| error.to_string());
        assert_eq!(
            message.as_deref(),
            Some("device library `/x/libdev.so`: `plughost_device_v1` returned a null table")
        );
    }

    #[test]
    fn missing_and_broken_files_name_the_path() {
        let missing = std::env::temp_dir().join("plughost-no-such-device.so");
        let message = DeviceLibrary::load(&missing).err().unwrap().to_string();
        assert_eq!(
            message,
            format!("device library `{}` does not exist", missing.display())
        );

        let not_a_library =
            std::env::temp_dir().join(format!("plughost-not-a-library-{}.so", std::process::id()));
        std::fs::write(&not_a_library, b"not an ELF file").unwrap();
        let error = DeviceLibrary::load(&not_a_library).err().unwrap();
        let _ = std::fs::remove_file(&not_a_library);
        assert!(matches!(error, DeviceError::LoadFailed { .. }), "{error}");
        assert!(
            error
                .to_string()
                .contains(&not_a_library.display().to_string()),
            "{error}"
        );
    }
}
