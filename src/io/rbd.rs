//! Ceph RBD images as backing devices, through librbd loaded at run time.
//!
//! A table names an image as `rbd:POOL/IMAGE[:conf=PATH][:id=USER]` (qemu's form)
//! anywhere it takes a device. librbd and librados are opened with `dlopen` the
//! first time a table names one, so neither the build nor a machine that never
//! uses RBD needs them. No crate binds librbd's asynchronous API (the `ceph` crates
//! wrap librados only, `ceph-rbd` is synchronous, `librbd-sys` was abandoned in
//! 2016), hence the thirty-odd declarations here.
//!
//! I/O is asynchronous: each operation gets a librbd completion whose callback,
//! on one of librbd's threads, only appends the result to the submitting queue's
//! [`RbdSink`] and signals its eventfd; the queue's owner reaps it with the rest
//! of its completions ([`crate::io::queue::IoQueue`]). librbd cannot cancel an
//! operation, so its buffer stays untouched until the completion is reaped, the
//! same contract as an io_uring submission.
//!
//! Images of one cluster (the same configuration file and user) share one
//! connection. A writable image is opened with librbd's exclusive lock taken and
//! kept, so a second daemon naming it for writing is refused until this one closes
//! it.

use crate::sync::Unpoison;
use std::ffi::{c_char, c_int, c_void, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, Weak};

type RadosT = *mut c_void;
type IoctxT = *mut c_void;
type ImageT = *mut c_void;
type CompletionT = *mut c_void;
type Callback = unsafe extern "C" fn(CompletionT, *mut c_void);

/// Seconds a connection attempt, a monitor command and an OSD operation may take
/// before they fail (librados waits forever by default, and a table load naming
/// an unreachable cluster would hang the control thread).
const CONNECT_TIMEOUT_S: &str = "10";
const OSD_OP_TIMEOUT_S: &str = "60";
const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;

/// The entry points, resolved once. The libraries stay loaded for the process.
struct Lib {
    _rados: libloading::Library,
    _rbd: libloading::Library,
    rados_create2: unsafe extern "C" fn(*mut RadosT, *const c_char, *const c_char, u64) -> c_int,
    rados_conf_read_file: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    rados_conf_set: unsafe extern "C" fn(RadosT, *const c_char, *const c_char) -> c_int,
    rados_conf_get: unsafe extern "C" fn(RadosT, *const c_char, *mut c_char, usize) -> c_int,
    rados_connect: unsafe extern "C" fn(RadosT) -> c_int,
    rados_shutdown: unsafe extern "C" fn(RadosT),
    rados_ioctx_create: unsafe extern "C" fn(RadosT, *const c_char, *mut IoctxT) -> c_int,
    rados_ioctx_destroy: unsafe extern "C" fn(IoctxT),
    rbd_open: unsafe extern "C" fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    rbd_open_read_only: unsafe extern "C" fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    rbd_close: unsafe extern "C" fn(ImageT) -> c_int,
    rbd_get_size: unsafe extern "C" fn(ImageT, *mut u64) -> c_int,
    rbd_lock_acquire: unsafe extern "C" fn(ImageT, c_int) -> c_int,
    rbd_lock_get_owners: unsafe extern "C" fn(ImageT, *mut c_int, *mut *mut c_char, *mut usize) -> c_int,
    rbd_lock_get_owners_cleanup: unsafe extern "C" fn(*mut *mut c_char, usize),
    rbd_read2: unsafe extern "C" fn(ImageT, u64, usize, *mut c_char, c_int) -> isize,
    rbd_write2: unsafe extern "C" fn(ImageT, u64, usize, *const c_char, c_int) -> isize,
    rbd_flush: unsafe extern "C" fn(ImageT) -> c_int,
    rbd_discard: unsafe extern "C" fn(ImageT, u64, u64) -> c_int,
    rbd_write_zeroes: unsafe extern "C" fn(ImageT, u64, usize, c_int, c_int) -> isize,
    rbd_aio_create_completion: unsafe extern "C" fn(*mut c_void, Callback, *mut CompletionT) -> c_int,
    rbd_aio_get_return_value: unsafe extern "C" fn(CompletionT) -> isize,
    rbd_aio_release: unsafe extern "C" fn(CompletionT),
    rbd_aio_read: unsafe extern "C" fn(ImageT, u64, usize, *mut c_char, CompletionT) -> c_int,
    rbd_aio_write: unsafe extern "C" fn(ImageT, u64, usize, *const c_char, CompletionT) -> c_int,
    rbd_aio_flush: unsafe extern "C" fn(ImageT, CompletionT) -> c_int,
    rbd_aio_discard: unsafe extern "C" fn(ImageT, u64, u64, CompletionT) -> c_int,
    rbd_aio_write_zeroes: unsafe extern "C" fn(ImageT, u64, usize, CompletionT, c_int, c_int) -> c_int,
}

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

fn lib() -> Result<&'static Lib, String> {
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Lib, String> {
    // SAFETY: loading librados/librbd runs their initialisers, which only set up
    // the libraries' own state.
    let open = |name: &str| {
        unsafe { libloading::Library::new(name) }.map_err(|e| {
            format!("{name} cannot be loaded ({e}); install librbd1 (Debian: apt-get install librbd1)")
        })
    };
    let rados = open("librados.so.2")?;
    let rbd = open("librbd.so.1")?;
    macro_rules! sym {
        ($l:expr, $n:ident) => {
            // SAFETY: the symbol has the C signature declared for it in `Lib`,
            // copied from Ceph's librados.h / librbd.h (16.2).
            *unsafe { $l.get(concat!(stringify!($n), "\0").as_bytes()) }
                .map_err(|e| format!("{}: {e}", stringify!($n)))?
        };
    }
    Ok(Lib {
        rados_create2: sym!(rados, rados_create2),
        rados_conf_read_file: sym!(rados, rados_conf_read_file),
        rados_conf_set: sym!(rados, rados_conf_set),
        rados_conf_get: sym!(rados, rados_conf_get),
        rados_connect: sym!(rados, rados_connect),
        rados_shutdown: sym!(rados, rados_shutdown),
        rados_ioctx_create: sym!(rados, rados_ioctx_create),
        rados_ioctx_destroy: sym!(rados, rados_ioctx_destroy),
        rbd_open: sym!(rbd, rbd_open),
        rbd_open_read_only: sym!(rbd, rbd_open_read_only),
        rbd_close: sym!(rbd, rbd_close),
        rbd_get_size: sym!(rbd, rbd_get_size),
        rbd_lock_acquire: sym!(rbd, rbd_lock_acquire),
        rbd_lock_get_owners: sym!(rbd, rbd_lock_get_owners),
        rbd_lock_get_owners_cleanup: sym!(rbd, rbd_lock_get_owners_cleanup),
        rbd_read2: sym!(rbd, rbd_read2),
        rbd_write2: sym!(rbd, rbd_write2),
        rbd_flush: sym!(rbd, rbd_flush),
        rbd_discard: sym!(rbd, rbd_discard),
        rbd_write_zeroes: sym!(rbd, rbd_write_zeroes),
        rbd_aio_create_completion: sym!(rbd, rbd_aio_create_completion),
        rbd_aio_get_return_value: sym!(rbd, rbd_aio_get_return_value),
        rbd_aio_release: sym!(rbd, rbd_aio_release),
        rbd_aio_read: sym!(rbd, rbd_aio_read),
        rbd_aio_write: sym!(rbd, rbd_aio_write),
        rbd_aio_flush: sym!(rbd, rbd_aio_flush),
        rbd_aio_discard: sym!(rbd, rbd_aio_discard),
        rbd_aio_write_zeroes: sym!(rbd, rbd_aio_write_zeroes),
        _rados: rados,
        _rbd: rbd,
    })
}

/// A device name of the `rbd:` form, parsed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RbdSpec {
    pub pool: String,
    pub image: String,
    /// Ceph configuration file (librados's default search when absent).
    pub conf: Option<PathBuf>,
    /// Ceph user, without `client.` (librados's default, `admin`, when absent).
    pub id: Option<String>,
}

impl RbdSpec {
    /// Parse `rbd:POOL/IMAGE[:conf=PATH][:id=USER]`; `None` when `name` does not
    /// start with `rbd:`.
    pub fn parse(name: &str) -> Option<Result<RbdSpec, String>> {
        let rest = name.strip_prefix("rbd:")?;
        Some(Self::parse_rest(rest).map_err(|e| format!("{name}: {e}")))
    }

    fn parse_rest(rest: &str) -> Result<RbdSpec, String> {
        let mut parts = rest.split(':');
        let path = parts.next().unwrap_or_default();
        let (pool, image) = path
            .split_once('/')
            .ok_or("expected rbd:POOL/IMAGE[:conf=PATH][:id=USER]")?;
        if pool.is_empty() || image.is_empty() {
            return Err("expected rbd:POOL/IMAGE[:conf=PATH][:id=USER]".into());
        }
        if image.contains('/') {
            return Err("RBD namespaces are not supported".into());
        }
        if image.contains('@') {
            return Err("RBD snapshots cannot back a table (map the image itself)".into());
        }
        let mut spec = RbdSpec {
            pool: pool.into(),
            image: image.into(),
            conf: None,
            id: None,
        };
        for opt in parts {
            match opt.split_once('=') {
                Some(("conf", v)) if !v.is_empty() => spec.conf = Some(PathBuf::from(v)),
                Some(("id", v)) if !v.is_empty() => spec.id = Some(v.into()),
                _ => {
                    return Err(format!(
                        "unknown option '{opt}' (conf=PATH and id=USER are known)"
                    ))
                }
            }
        }
        Ok(spec)
    }
}

impl std::fmt::Display for RbdSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rbd:{}/{}", self.pool, self.image)?;
        if let Some(c) = &self.conf {
            write!(f, ":conf={}", c.display())?;
        }
        if let Some(i) = &self.id {
            write!(f, ":id={i}")?;
        }
        Ok(())
    }
}

fn cstr(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

fn strerror(r: i64) -> String {
    io::Error::from_raw_os_error((-r) as i32).to_string()
}

/// One cluster connection (librados handle) and the pools opened on it.
struct Cluster {
    handle: RadosT,
    pools: Mutex<Vec<(String, Weak<PoolCtx>)>>,
}

// SAFETY: a librados handle may be used from any thread (librados is thread-safe).
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Ok(l) = lib() {
            // SAFETY: the handle was connected by `Cluster::connect` and every pool
            // context on it is gone (each holds the cluster).
            unsafe { (l.rados_shutdown)(self.handle) };
        }
    }
}

type ClusterKey = (Option<PathBuf>, Option<String>);
/// The cluster connections open in this process, by (ceph.conf, user).
/// Process-wide on purpose: a connection is a heavyweight librados client
/// (threads, sockets, a session with the monitors), and every image of one
/// cluster, whichever registry or table opens it, shares it.
static CLUSTERS: Mutex<Vec<(ClusterKey, Weak<Cluster>)>> = Mutex::new(Vec::new());

impl Cluster {
    fn get(spec: &RbdSpec) -> Result<Arc<Cluster>, String> {
        let key = (spec.conf.clone(), spec.id.clone());
        super::shared(&CLUSTERS, key, || Cluster::connect(spec))
    }

    fn connect(spec: &RbdSpec) -> Result<Cluster, String> {
        let l = lib()?;
        let user = format!("client.{}", spec.id.as_deref().unwrap_or("admin"));
        let user = cstr(&user, "the user name")?;
        let mut h: RadosT = std::ptr::null_mut();
        // SAFETY: `h` is written by rados_create2; the strings are NUL-terminated.
        let r = unsafe { (l.rados_create2)(&mut h, c"ceph".as_ptr(), user.as_ptr(), 0) };
        if r < 0 {
            return Err(format!("cannot create a cluster handle: {}", strerror(r.into())));
        }
        // From here on the handle is shut down on every error path.
        let c = Cluster {
            handle: h,
            pools: Mutex::new(Vec::new()),
        };
        let conf = match &spec.conf {
            Some(p) => Some(cstr(&p.to_string_lossy(), "the conf path")?),
            None => None,
        };
        // SAFETY: a live handle; NULL asks for the default search path.
        let r =
            unsafe { (l.rados_conf_read_file)(h, conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())) };
        if r < 0 {
            let which = spec
                .conf
                .as_ref()
                .map_or("the default Ceph configuration".to_string(), |p| {
                    p.display().to_string()
                });
            return Err(format!("cannot read {which}: {}", strerror(r.into())));
        }
        c.conf_set("client_mount_timeout", CONNECT_TIMEOUT_S)?;
        // librbd keeps its cache write-through until the client's first flush,
        // for guests that never flush. dmkit passes every flush and FUA on (and
        // the export offers them), so write-back from the start: 4 KiB random
        // writes at QD32 went from 4.7-5.0K to 9.0K IOPS here.
        c.conf_set("rbd_cache_writethrough_until_flush", "false")?;
        c.conf_set("rados_mon_op_timeout", CONNECT_TIMEOUT_S)?;
        if c.conf_get("rados_osd_op_timeout")
            .is_none_or(|v| v.parse::<f64>().is_ok_and(|t| t == 0.0))
        {
            c.conf_set("rados_osd_op_timeout", OSD_OP_TIMEOUT_S)?;
        }
        // SAFETY: a configured handle.
        let r = unsafe { (l.rados_connect)(h) };
        if r < 0 {
            let why = match -r {
                libc::ETIMEDOUT => {
                    format!("cluster unreachable (no monitor answered in {CONNECT_TIMEOUT_S} s)")
                }
                libc::EACCES | libc::EPERM => {
                    "permission denied by the cluster (check the user and its key)".into()
                }
                _ => format!("cannot connect to the cluster: {}", strerror(r.into())),
            };
            return Err(why);
        }
        Ok(c)
    }

    fn conf_set(&self, k: &str, v: &str) -> Result<(), String> {
        let l = lib()?;
        let (kc, vc) = (cstr(k, k)?, cstr(v, k)?);
        // SAFETY: a live handle and NUL-terminated strings.
        let r = unsafe { (l.rados_conf_set)(self.handle, kc.as_ptr(), vc.as_ptr()) };
        if r < 0 {
            return Err(format!("cannot set {k}: {}", strerror(r.into())));
        }
        Ok(())
    }

    fn conf_get(&self, k: &str) -> Option<String> {
        let l = lib().ok()?;
        let kc = cstr(k, k).ok()?;
        let mut buf = [0u8; 128];
        // SAFETY: a live handle; librados writes at most `buf.len()` bytes.
        let r = unsafe { (l.rados_conf_get)(self.handle, kc.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if r < 0 {
            return None;
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Some(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    fn pool(self: &Arc<Self>, name: &str) -> Result<Arc<PoolCtx>, String> {
        super::shared(&self.pools, name.to_string(), || {
            let l = lib()?;
            let n = cstr(name, "the pool name")?;
            let mut io: IoctxT = std::ptr::null_mut();
            // SAFETY: a connected handle; `io` is written on success.
            let r = unsafe { (l.rados_ioctx_create)(self.handle, n.as_ptr(), &mut io) };
            if r < 0 {
                return Err(match -r {
                    libc::ENOENT => format!("pool '{name}' does not exist"),
                    _ => format!("cannot open pool '{name}': {}", strerror(r.into())),
                });
            }
            Ok(PoolCtx {
                _cluster: self.clone(),
                io,
            })
        })
    }
}

struct PoolCtx {
    /// Held so the connection outlives its I/O contexts.
    _cluster: Arc<Cluster>,
    io: IoctxT,
}

// SAFETY: an I/O context may be used from any thread (librados is thread-safe).
unsafe impl Send for PoolCtx {}
// SAFETY: as above.
unsafe impl Sync for PoolCtx {}

impl Drop for PoolCtx {
    fn drop(&mut self) {
        if let Ok(l) = lib() {
            // SAFETY: the context was created by `Cluster::pool`; every image on it
            // is closed (each holds the context).
            unsafe { (l.rados_ioctx_destroy)(self.io) };
        }
    }
}

/// An open RBD image.
pub struct RbdImage {
    pub spec: RbdSpec,
    /// Held so the I/O context outlives the image.
    _pool: Arc<PoolCtx>,
    image: ImageT,
    pub read_only: bool,
}

// SAFETY: librbd image handles may be used from any thread; librbd serialises
// internally.
unsafe impl Send for RbdImage {}
// SAFETY: as above.
unsafe impl Sync for RbdImage {}

impl std::fmt::Debug for RbdImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RbdImage({})", self.spec)
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        if let Ok(l) = lib() {
            // SAFETY: every operation on the image has completed: its tables (and
            // their requests) are gone, and the engines reap every completion
            // before they free a buffer. Closing releases the exclusive lock.
            unsafe { (l.rbd_close)(self.image) };
        }
    }
}

impl RbdImage {
    /// Open `spec`; writable images take librbd's exclusive lock and keep it.
    pub fn open(spec: &RbdSpec, read_only: bool) -> Result<RbdImage, String> {
        let l = lib()?;
        let cluster = Cluster::get(spec)?;
        let pool = cluster.pool(&spec.pool)?;
        let name = cstr(&spec.image, "the image name")?;
        let mut image: ImageT = std::ptr::null_mut();
        let open = if read_only {
            l.rbd_open_read_only
        } else {
            l.rbd_open
        };
        // SAFETY: a live I/O context; `image` is written on success.
        let r = unsafe { open(pool.io, name.as_ptr(), &mut image, std::ptr::null()) };
        if r < 0 {
            return Err(match -r {
                libc::ENOENT => format!("image '{}' does not exist in pool '{}'", spec.image, spec.pool),
                libc::EACCES | libc::EPERM => "permission denied".into(),
                libc::ETIMEDOUT => "timed out (are the OSDs up?)".into(),
                _ => strerror(r.into()),
            });
        }
        let img = RbdImage {
            spec: spec.clone(),
            _pool: pool,
            image,
            read_only,
        };
        if !read_only {
            // SAFETY: an open image.
            let r = unsafe { (l.rbd_lock_acquire)(image, RBD_LOCK_MODE_EXCLUSIVE) };
            if r < 0 {
                return Err(match -r {
                    libc::EROFS | libc::EBUSY => format!(
                        "image is locked by another client ({}); stop or fence it first",
                        img.lock_owners().unwrap_or_else(|| "owner unknown".into())
                    ),
                    libc::EINVAL | libc::EOPNOTSUPP => {
                        "image lacks the exclusive-lock feature (rbd feature enable POOL/IMAGE exclusive-lock)"
                            .into()
                    }
                    _ => format!("cannot take the exclusive lock: {}", strerror(r.into())),
                });
            }
        }
        Ok(img)
    }

    fn lock_owners(&self) -> Option<String> {
        let l = lib().ok()?;
        let mut mode: c_int = 0;
        let mut owners: [*mut c_char; 8] = [std::ptr::null_mut(); 8];
        let mut n: usize = owners.len();
        // SAFETY: an open image; librbd fills at most `n` owner strings.
        let r = unsafe { (l.rbd_lock_get_owners)(self.image, &mut mode, owners.as_mut_ptr(), &mut n) };
        if r < 0 {
            return None;
        }
        let names: Vec<String> = owners[..n.min(owners.len())]
            .iter()
            .filter(|p| !p.is_null())
            // SAFETY: librbd returned NUL-terminated strings.
            .map(|&p| {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        // SAFETY: the array librbd filled, with its count.
        unsafe { (l.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), n) };
        Some(names.join(", "))
    }

    /// Size in bytes (asked each time: images grow with `rbd resize`).
    pub fn size(&self) -> io::Result<u64> {
        let l = lib().map_err(io::Error::other)?;
        let mut s = 0u64;
        // SAFETY: an open image.
        check(unsafe { (l.rbd_get_size)(self.image, &mut s) }.into())?;
        Ok(s)
    }

    /// Read at `off`; reads past the end return fewer bytes.
    pub fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let l = lib().map_err(io::Error::other)?;
        // SAFETY: `buf` is valid for its length for the duration of the call.
        let r = unsafe { (l.rbd_read2)(self.image, off, buf.len(), buf.as_mut_ptr().cast(), 0) };
        check(r as i64).map(|n| n as usize)
    }

    pub fn write_all_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let l = lib().map_err(io::Error::other)?;
        // SAFETY: `buf` is valid for its length for the duration of the call.
        let r = unsafe { (l.rbd_write2)(self.image, off, buf.len(), buf.as_ptr().cast(), 0) };
        let n = check(r as i64)?;
        if (n as usize) < buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "short write to an RBD image",
            ));
        }
        Ok(())
    }

    pub fn flush(&self) -> io::Result<()> {
        let l = lib().map_err(io::Error::other)?;
        // SAFETY: an open image.
        check(unsafe { (l.rbd_flush)(self.image) }.into()).map(drop)
    }

    pub fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        let l = lib().map_err(io::Error::other)?;
        // SAFETY: an open image.
        check(unsafe { (l.rbd_discard)(self.image, off, len) }.into()).map(drop)
    }

    pub fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        let l = lib().map_err(io::Error::other)?;
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: an open image.
        check(unsafe { (l.rbd_write_zeroes)(self.image, off, len, 0, 0) } as i64).map(drop)
    }

    /// A copyable reference for the request path ([`crate::io::backing::FileHandle`]).
    pub fn handle(&self) -> RbdRef {
        RbdRef(NonNull::from(self))
    }
}

fn check(r: i64) -> io::Result<u64> {
    if r < 0 {
        Err(io::Error::from_raw_os_error((-r) as i32))
    } else {
        Ok(r as u64)
    }
}

/// A plain pointer to an open image, for the request path: like the descriptors
/// of a file handle, valid while the table that owns the image lives, which
/// outlives every request mapped through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RbdRef(NonNull<RbdImage>);

// SAFETY: it points at an `RbdImage`, which is Send + Sync; the table owning the
// image outlives every request that carries the reference (see above).
unsafe impl Send for RbdRef {}
// SAFETY: as above.
unsafe impl Sync for RbdRef {}

impl RbdRef {
    fn image(&self) -> &RbdImage {
        // SAFETY: see the type's comment: the image outlives every use.
        unsafe { self.0.as_ref() }
    }
}

/// The operations of the asynchronous path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RbdOp {
    Read,
    /// `fua`: a flush follows before the write completes (RBD has no FUA write).
    Write {
        fua: bool,
    },
    Flush,
    Discard,
    WriteZeroes,
}

/// Where librbd's callbacks leave the results of one queue's operations:
/// (user data, result, a flush still to issue for a FUA write). The eventfd is
/// signalled when the list becomes non-empty.
pub struct RbdSink {
    done: Mutex<Vec<Done>>,
    efd: OwnedFd,
}

pub struct Done {
    pub user_data: u64,
    pub res: i32,
    /// A FUA write whose data is written: its flush is still to go out.
    pub then_flush: Option<RbdRef>,
}

impl RbdSink {
    pub fn new() -> io::Result<Arc<RbdSink>> {
        // SAFETY: eventfd has no memory arguments; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(RbdSink {
            done: Mutex::new(Vec::new()),
            // SAFETY: a descriptor just created and owned by nothing else.
            efd: unsafe { OwnedFd::from_raw_fd(fd) },
        }))
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        self.efd.as_raw_fd()
    }

    /// Take every result left so far.
    pub fn take(&self, into: &mut Vec<Done>) {
        let mut d = self.done.lock().unpoisoned();
        into.append(&mut d);
    }

    fn put(&self, d: Done) {
        let first = {
            let mut list = self.done.lock().unpoisoned();
            list.push(d);
            list.len() == 1
        };
        if first {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our eventfd.
            unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

/// The state of one operation in flight, owned by its completion's callback.
struct Pending {
    sink: Arc<RbdSink>,
    user_data: u64,
    op: RbdOp,
    img: RbdRef,
    buf: *mut u8,
    len: usize,
}

unsafe extern "C" fn on_complete(c: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the Box leaked by `submit` for exactly this completion,
    // which librbd calls back once.
    let p = unsafe { Box::from_raw(arg.cast::<Pending>()) };
    let Ok(l) = lib() else { return };
    // SAFETY: the completion is ours and not yet released.
    let r = unsafe { (l.rbd_aio_get_return_value)(c) };
    // SAFETY: released once, after its value was taken.
    unsafe { (l.rbd_aio_release)(c) };
    let res = if r < 0 {
        r as i32
    } else {
        match p.op {
            RbdOp::Read => {
                // A read never comes back short but past the end: whatever it did
                // not fill reads as zeroes, and the whole length is done.
                if (r as usize) < p.len {
                    // SAFETY: `buf..buf+len` is the operation's buffer, untouched by
                    // anyone else until this result is reaped.
                    unsafe { std::ptr::write_bytes(p.buf.add(r as usize), 0, p.len - r as usize) };
                }
                p.len as i32
            }
            // A flush reports the length of the FUA write it completes (0 alone).
            RbdOp::Write { .. } | RbdOp::Flush => p.len as i32,
            _ => 0,
        }
    };
    let then_flush = (res >= 0 && p.op == RbdOp::Write { fua: true }).then_some(p.img);
    p.sink.put(Done {
        user_data: p.user_data,
        res,
        then_flush,
    });
}

/// Start `op` on `img`; its result goes to `sink` with `user_data`. An error
/// returned here means nothing was started.
///
/// # Safety
/// `buf..buf+len` (reads and writes) must stay valid and otherwise untouched
/// until the result has been taken from the sink.
pub unsafe fn submit(
    img: RbdRef,
    op: RbdOp,
    buf: *mut u8,
    len: usize,
    offset: u64,
    sink: &Arc<RbdSink>,
    user_data: u64,
) -> Result<(), i32> {
    let l = lib().map_err(|_| libc::EIO)?;
    let p = Box::into_raw(Box::new(Pending {
        sink: sink.clone(),
        user_data,
        op,
        img,
        buf,
        len,
    }));
    let mut c: CompletionT = std::ptr::null_mut();
    // SAFETY: `p` is handed to the callback, which frees it.
    let r = unsafe { (l.rbd_aio_create_completion)(p.cast(), on_complete, &mut c) };
    if r < 0 {
        // SAFETY: the callback will never run; `p` is still ours.
        drop(unsafe { Box::from_raw(p) });
        return Err(-r);
    }
    let im = img.image().image;
    // SAFETY: the caller keeps the buffer alive until the result is reaped; the
    // image outlives the operation (RbdRef's contract).
    let r = unsafe {
        match op {
            RbdOp::Read => (l.rbd_aio_read)(im, offset, len, buf.cast(), c),
            RbdOp::Write { .. } => (l.rbd_aio_write)(im, offset, len, buf.cast_const().cast(), c),
            RbdOp::Flush => (l.rbd_aio_flush)(im, c),
            RbdOp::Discard => (l.rbd_aio_discard)(im, offset, len as u64, c),
            RbdOp::WriteZeroes => (l.rbd_aio_write_zeroes)(im, offset, len, c, 0, 0),
        }
    };
    if r < 0 {
        // SAFETY: the operation was refused, so the callback will not run.
        unsafe {
            (l.rbd_aio_release)(c);
            drop(Box::from_raw(p));
        }
        return Err(-r);
    }
    Ok(())
}

/// Whether librbd can be loaded here (for messages and tests).
pub fn available() -> Result<(), String> {
    lib().map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_as_qemu_writes_them() {
        let s = RbdSpec::parse("rbd:rbd/img").unwrap().unwrap();
        assert_eq!(
            (s.pool.as_str(), s.image.as_str(), s.conf, s.id),
            ("rbd", "img", None, None)
        );
        let s = RbdSpec::parse("rbd:p/i:conf=/tmp/c/ceph.conf:id=dmkit")
            .unwrap()
            .unwrap();
        assert_eq!(s.conf.as_deref(), Some(std::path::Path::new("/tmp/c/ceph.conf")));
        assert_eq!(s.id.as_deref(), Some("dmkit"));
        assert_eq!(s.to_string(), "rbd:p/i:conf=/tmp/c/ceph.conf:id=dmkit");
        assert!(RbdSpec::parse("/dev/sda").is_none());
        for bad in [
            "rbd:",
            "rbd:pool",
            "rbd:/img",
            "rbd:p/",
            "rbd:p/i@snap",
            "rbd:p/i:mode=x",
            "rbd:p/ns/i",
        ] {
            let e = RbdSpec::parse(bad).unwrap().unwrap_err();
            assert!(e.starts_with(bad), "{e}");
        }
    }
}
