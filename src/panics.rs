//! What a panic does in the daemon.
//!
//! One rule: a panic while a frontend's engine maps a request, or runs a target's
//! completion hook for it, is caught there; that request fails with EIO, and so
//! does every later request to the device being served, which is marked failed
//! (`Device::fail`); the daemon and its other devices go on. A panic anywhere else
//! (a target's own thread such as a pool's commit thread or a writecache's
//! writeback, the control path, a frontend's own bookkeeping) cannot be made
//! safe: shared metadata may be half changed, and requests or the kernel's ublk
//! tags may wait on the thread for ever. There the daemon exits at once, before
//! anything half changed is committed; the ublk driver quiesces its block devices
//! and `serve --restore` takes them over (NBD clients reconnect).
//!
//! A panic caught on an engine thread may have left a target's lock poisoned;
//! the targets whose state is shared between devices (a thin pool's metadata, a
//! writecache, a snapshot store) take their locks through [`poisoned`], which
//! exits as above rather than carry on from half-changed state.
//!
//! The hook logs every panic with its thread, the device the thread serves and
//! the location.

use std::cell::{Cell, RefCell};

thread_local! {
    /// The device this thread serves (an export's, a pool's), for the log.
    static DEVICE: RefCell<String> = const { RefCell::new(String::new()) };
    /// Inside [`catching`]: a panic here is caught by the caller.
    static CATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Name the device this thread serves, for the panic log.
pub fn set_device(name: &str) {
    DEVICE.with(|d| {
        let mut d = d.borrow_mut();
        d.clear();
        d.push_str(name);
    });
}

fn device() -> String {
    DEVICE
        .try_with(|d| d.try_borrow().map(|d| d.clone()).unwrap_or_default())
        .unwrap_or_default()
}

/// Install the hook (the daemon, once at start).
pub fn install_hook() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("unnamed");
        let dev = device();
        let dev = if dev.is_empty() {
            "no device".into()
        } else {
            format!("device {dev}")
        };
        let at = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "an unknown location".into());
        if CATCHING.try_with(Cell::get).unwrap_or(false) {
            tracing::error!(
                "panic in thread {thread} serving {dev} at {at}: {msg}; the request fails with EIO, and so does all later I/O to the device"
            );
        } else {
            exit(&format!("panic in thread {thread} serving {dev} at {at}: {msg}"));
        }
    }));
}

/// Log `why` and end the daemon now (see the module's comment).
pub fn exit(why: &str) -> ! {
    tracing::error!(
        "{why}; the daemon exits so nothing half changed is committed (`serve --restore` takes its devices over)"
    );
    std::process::abort()
}

/// Run `f`, catching a panic in it (logged by the hook): `None` if it panicked.
pub fn catching<R>(f: impl FnOnce() -> R) -> Option<R> {
    let was = CATCHING.with(|c| c.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(was));
    r.ok()
}

/// A lock that a panicking thread left behind: its state may be half changed.
pub fn poisoned(what: &str) -> ! {
    exit(&format!(
        "{what}: a thread panicked while changing it (its lock is poisoned)"
    ))
}

static TEST_PANICS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `serve --test-panics` (for tests only, and logged) enables the `__panic`
/// message, which makes the device's next request panic where it is mapped
/// (the tests of this module's rule). Off, no client can make the daemon panic.
pub fn enable_test_panics() {
    TEST_PANICS.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`enable_test_panics`] was called.
pub fn test_panics_enabled() -> bool {
    TEST_PANICS.load(std::sync::atomic::Ordering::Relaxed)
}
