//! `dmkit serve`: the control socket, the NBD listeners and the demo set-up.

use crate::mapper::{config::Config, Registry};
use anyhow::{bail, Context, Result};
use nix::sys::signal::{SigSet, Signal};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What `serve --background`'s child calls once it is ready, with the lines the
/// user hears first.
pub type Ready = Box<dyn FnOnce(&str) + Send>;

pub struct ServeOptions {
    pub run_dir: PathBuf,
    pub nbd_listen: Option<String>,
    /// NBD reactor threads (0: one per core).
    pub nbd_reactors: usize,
    /// TLS on the NBD listeners (unix and TCP).
    pub tls: crate::export::nbd::tls::Options,
    pub group: Option<String>,
    pub demo: Option<PathBuf>,
    pub direct_io: bool,
    /// The copy engine's sub-job size in KiB (kcopyd_subjob_size_kb).
    pub copy_subjob_kb: u64,
    /// Writecache writeback in LRU order (the pre-2019 kernel), for benchmarks.
    pub writecache_lru_writeback: bool,
    /// Make the devices recorded in the run directory again, and take over the
    /// block devices they were attached as.
    pub restore: bool,
    /// Attach every device as a ublk block device at its resume (`--attach`).
    pub attach: bool,
    /// Devices to serve as vhost-user-blk disks, each on its socket, when a
    /// table is resumed on them (`--vhost-user NAME=SOCKET`).
    pub vhost_user: Vec<(String, PathBuf)>,
    /// Timings and switches set by `serve`'s options (never by the environment).
    pub tuning: Tuning,
    /// Called once the sockets are listening and the devices are made (the
    /// parent of `serve --background` waits for it), with what the user should
    /// hear first: lines on devices of an earlier daemon (waiting to be
    /// restored, or restored), and what the demo found.
    pub ready: Option<Ready>,
}

/// What `serve`'s options change in the daemon's behaviour; the `test_` ones
/// exist for tests only, and each one set is logged at start.
#[derive(Debug)]
pub struct Tuning {
    pub thin_no_space_timeout: std::time::Duration,
    pub nbd_handshake_timeout: std::time::Duration,
    pub no_io_uring: bool,
    pub test_thin_commit_period: Option<std::time::Duration>,
    pub test_passdown_delay: Option<std::time::Duration>,
    pub test_discard_delay: Option<std::time::Duration>,
    pub test_restart_log_records: Option<usize>,
    pub test_panics: bool,
    pub test_no_memory_trim: bool,
}

impl Default for Tuning {
    fn default() -> Tuning {
        let c = Config::default();
        Tuning {
            thin_no_space_timeout: c.thin_no_space_timeout,
            nbd_handshake_timeout: std::time::Duration::from_secs(30),
            no_io_uring: false,
            test_thin_commit_period: None,
            test_passdown_delay: None,
            test_discard_delay: None,
            test_restart_log_records: None,
            test_panics: false,
            test_no_memory_trim: false,
        }
    }
}

impl Tuning {
    /// Apply the process-wide ones and log every one that is not the default;
    /// the registry's are returned in `config`.
    fn apply(&self, config: &mut Config) {
        let d = Tuning::default();
        if self.thin_no_space_timeout != d.thin_no_space_timeout {
            tracing::info!(
                "thin pools out of data space queue writes for {:?}",
                self.thin_no_space_timeout
            );
        }
        config.thin_no_space_timeout = self.thin_no_space_timeout;
        if self.nbd_handshake_timeout != d.nbd_handshake_timeout {
            tracing::info!(
                "NBD clients have {:?} to finish the handshake",
                self.nbd_handshake_timeout
            );
        }
        crate::export::nbd::set_handshake_timeout(self.nbd_handshake_timeout);
        if self.no_io_uring {
            tracing::info!("--no-io-uring: backing I/O goes through the synchronous queue");
            crate::io::queue::disable_io_uring();
        }
        if let Some(t) = self.test_thin_commit_period {
            tracing::warn!("for tests: thin pools commit every {t:?} (--test-thin-commit-period-ms)");
            config.thin_commit_period = t;
        }
        if let Some(t) = self.test_passdown_delay {
            tracing::warn!("for tests: thin discard passdown delayed by {t:?} (--test-passdown-delay-ms)");
            config.thin_passdown_delay = t;
        }
        if let Some(t) = self.test_discard_delay {
            tracing::warn!("for tests: thin discards delayed by {t:?} (--test-discard-delay-ms)");
            config.thin_discard_delay = t;
        }
        if let Some(n) = self.test_restart_log_records {
            tracing::warn!("for tests: restart logs hold {n} records (--test-restart-log-records)");
            config.restart_log_records = Some(n);
        }
        if self.test_no_memory_trim {
            tracing::warn!("for tests: freed memory stays in the heap (--test-no-memory-trim)");
            crate::control::keep_freed_memory();
        }
        if self.test_panics {
            tracing::warn!("for tests: the __panic message is accepted (--test-panics)");
            crate::panics::enable_test_panics();
        }
    }
}

/// Where the daemon records its devices (`control::state`).
pub fn state_path(run_dir: &Path) -> PathBuf {
    run_dir.join("devices.state")
}

pub use crate::client::default_run_dir;

/// Buffers of 128 KiB and more are mapped and unmapped by the C library each
/// time (its default, before it raises the threshold to the largest block freed
/// so far). The daemon's large buffers live as long as their devices (a ublk
/// queue's: 128 of 512 KiB): above a raised threshold they would come from the
/// heap, zeroed page by page at once (so resident in full, though mostly never
/// used) and kept by the heap after their device is gone.
fn fixed_mmap_threshold() {
    // SAFETY: mallopt only sets a tunable of the C library's allocator; it is
    // called before the daemon starts its threads.
    let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10) };
    if ok != 1 {
        tracing::warn!("mallopt(M_MMAP_THRESHOLD) refused: large buffers may stay resident");
    }
}

fn group_id(name: &str) -> Result<u32> {
    if let Ok(g) = name.parse::<u32>() {
        return Ok(g);
    }
    match nix::unistd::Group::from_name(name) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => bail!("unknown group '{name}'"),
        Err(e) => bail!("looking up group '{name}': {e}"),
    }
}

/// Bind a unix socket at `path` (replacing a stale one) with mode 0600, or 0660 and
/// the given group.
fn bind(path: &Path, group: Option<u32>) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("{}: another dmkit daemon is listening there", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    if let Some(g) = group {
        std::os::unix::fs::chown(path, None, Some(g))?;
    }
    Ok(l)
}

/// Block SIGINT/SIGTERM in every thread (threads inherit the mask), so that one
/// thread can wait for them and shut down cleanly.
fn block_signals() -> Result<SigSet> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().context("blocking SIGINT and SIGTERM")?;
    Ok(set)
}

/// Every client connection is a descriptor: take the hard limit on open files
/// as the daemon's own (the soft limit is often 1,024).
fn raise_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if l.current < l.maximum {
        l.current = l.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, l) {
            tracing::warn!("cannot raise the limit on open files: {e}");
        }
    }
}

pub fn serve(opts: ServeOptions) -> Result<()> {
    fixed_mmap_threshold();
    let set = block_signals()?;
    crate::panics::install_hook();
    raise_file_limit();
    let group = opts.group.as_deref().map(group_id).transpose()?;
    let tls = Arc::new(crate::export::nbd::tls::Tls::new(&opts.tls)?);
    std::fs::create_dir_all(&opts.run_dir).with_context(|| format!("creating {}", opts.run_dir.display()))?;
    let major = choose_major(&opts.run_dir)?;
    crate::mapper::Major::set(major);
    let mut config = Config {
        direct_io: opts.direct_io,
        restart_logs: Some(opts.run_dir.join("uncommitted")),
        copy_subjob_kb: opts.copy_subjob_kb,
        writecache_lru_writeback: opts.writecache_lru_writeback,
        ..Config::default()
    };
    opts.tuning.apply(&mut config);
    let reg = Arc::new(Registry::new(config, crate::targets::types()));
    let control_path = opts.run_dir.join("control.sock");
    let nbd_path = opts.run_dir.join("nbd.sock");
    let control = bind(&control_path, group)?;
    let nbd = bind(&nbd_path, group)?;
    let door_path = opts.run_dir.join(crate::control::door::SOCKET);
    let door = bind(&door_path, group)?;
    let state = state_path(&opts.run_dir);
    let prev = crate::control::state::prev_path(&state);
    // what the user hears first (serve --background prints it before its own line)
    let mut notes = String::new();
    if opts.attach {
        // every device is to become a block device: without ublk none would,
        // silently; say so now rather than at the first create
        crate::export::ublk::available().map_err(|e| anyhow::anyhow!("serve --attach: {e}"))?;
    }
    if !opts.restore {
        notes.push_str(&set_aside_earlier_devices(&state, &prev));
    }
    let ctx = Arc::new(crate::control::Ctx {
        run_dir: Some(opts.run_dir.clone()),
        auto_attach: opts.attach,
        ..crate::control::Ctx::new(reg.clone(), Some(state.clone()))
    });
    ctx.ublk
        .set_map_dir(opts.run_dir.join(crate::export::ublk::MAP_DIR));
    for (name, socket) in &opts.vhost_user {
        ctx.vhost.want(name, socket.clone());
    }
    if let Some(g) = group {
        ctx.files.set_group(g);
    }
    if opts.restore {
        notes.push_str(&restore_devices(&ctx, &state, &prev)?);
    }
    start_nbd(&opts, &reg, &tls, nbd)?;
    {
        let ctx = ctx.clone();
        accept_each("control", "control-conn", control, move |mut s| {
            // a client that left before its answer (`dmkit table | head`), or
            // connected only to see that a daemon is there (a second daemon's probe)
            connection_ended("control", crate::control::handle(&mut s, &ctx), true);
        })?;
    }
    {
        let ctx = ctx.clone();
        accept_each("dm-door", "dm-door-conn", door, move |mut s| {
            // the program left before its answer (a waiter interrupted by a
            // signal drops its connection)
            connection_ended(
                "dm ioctl door",
                crate::control::door::serve_connection(&mut s, &ctx),
                false,
            );
        })?;
    }
    tracing::info!(
        "serving: control {} nbd {} dm ioctl door {}",
        control_path.display(),
        nbd_path.display(),
        door_path.display()
    );
    if let Some(dir) = &opts.demo {
        demo(&reg, dir, &nbd_path, opts.nbd_listen.as_deref())?;
    }
    let notes = notes;
    // the pid for scripts (`kill $(cat RUN_DIR/serve.pid)`), once it answers
    let pid_path = opts.run_dir.join("serve.pid");
    if let Err(e) = std::fs::write(&pid_path, format!("{}\n", std::process::id())) {
        tracing::warn!("writing {}: {e}", pid_path.display());
    }
    if let Some(ready) = opts.ready {
        ready(&notes);
    }
    notify_systemd();
    // Wait for SIGINT/SIGTERM, then make everything durable and leave.
    let sig = set.wait().context("waiting for a signal")?;
    tracing::info!("{sig}: flushing devices and exiting");
    shut_down(&ctx, &reg, &[&control_path, &nbd_path, &door_path, &pid_path]);
    Ok(())
}

/// The NBD reactors, and the threads that accept NBD clients on the run
/// directory's socket and, with `--nbd-listen`, over TCP.
fn start_nbd(
    opts: &ServeOptions,
    reg: &Arc<Registry>,
    tls: &Arc<crate::export::nbd::tls::Tls>,
    nbd: UnixListener,
) -> Result<()> {
    let n = match opts.nbd_reactors {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let reactors =
        crate::export::nbd::reactor::Reactors::start(n, reg).context("starting the NBD reactors")?;
    {
        let (reg, tls, reactors) = (reg.clone(), tls.clone(), reactors.clone());
        std::thread::Builder::new()
            .name("nbd-unix".into())
            .spawn(move || crate::export::nbd::serve_unix(nbd, reg, tls, reactors))?;
    }
    if let Some(addr) = &opts.nbd_listen {
        let l = TcpListener::bind(addr).with_context(|| format!("listening on {addr}"))?;
        let (reg, tls) = (reg.clone(), tls.clone());
        std::thread::Builder::new()
            .name("nbd-tcp".into())
            .spawn(move || crate::export::nbd::serve_tcp(l, reg, tls, reactors))?;
        tracing::info!("NBD over TCP on {addr}");
    }
    Ok(())
}

/// After SIGINT or SIGTERM: everything made durable, the daemon's files gone.
fn shut_down(ctx: &crate::control::Ctx, reg: &Registry, files: &[&Path]) {
    // Block devices stay (with recovery the kernel holds their requests for the
    // next daemon); what their queues took is finished first, so the flush
    // below covers every request acknowledged.
    ctx.ublk.pause_all(std::time::Duration::from_secs(30));
    for d in reg.list() {
        let _ = d.flush_sync();
    }
    reg.sync_targets();
    ctx.files.unmount();
    for f in files {
        let _ = std::fs::remove_file(f);
    }
}

/// Sets aside the state file a previous daemon left (its devices are not made
/// again without `--restore`: a restore replays tables naming files that may have
/// changed, and replaces what a user may have set up meanwhile by hand); the line
/// that says so, empty if there were none.
fn set_aside_earlier_devices(state: &Path, prev: &Path) -> String {
    let waiting = |n: usize, whose: &str, at: &Path| {
        format!(
            "{n} devices of {whose} are waiting, not made again (recorded in {}): stop this daemon and \
             run `dmkit serve --restore` to make them again\n",
            at.display()
        )
    };
    if state.exists() {
        let devices = recorded_devices(state);
        if let Ok(prev) = crate::control::state::set_aside(state) {
            let line = waiting(devices, "the previous daemon", &prev);
            tracing::warn!("{}", line.trim_end());
            if devices > 0 {
                return line;
            }
        }
    } else if prev.exists() {
        let devices = recorded_devices(prev);
        if devices > 0 {
            let line = waiting(devices, "an earlier daemon", prev);
            tracing::warn!("{}", line.trim_end());
            return line;
        }
    }
    String::new()
}

/// `serve --restore`: makes the recorded devices again; the line that says how
/// many, empty if nothing was recorded.
fn restore_devices(ctx: &crate::control::Ctx, state: &Path, prev: &Path) -> Result<String> {
    if prev.exists() && recorded_devices(state) == 0 {
        // set aside by a daemon started without --restore that made no devices
        tracing::info!(
            "restoring from {} ({} records no devices)",
            prev.display(),
            state.display()
        );
        std::fs::rename(prev, state)
            .with_context(|| format!("moving {} to {}", prev.display(), state.display()))?;
    }
    if !state.exists() {
        tracing::info!(
            "nothing to restore: neither {} nor {} exists",
            state.display(),
            prev.display()
        );
        return Ok(String::new());
    }
    let (ok, errors) = crate::control::state::restore(ctx, state)
        .with_context(|| format!("restoring from {}", state.display()))?;
    for e in &errors {
        tracing::error!("restore: {e}");
    }
    let line = format!(
        "restored {ok} devices ({} attached as block devices) from {}{}",
        ctx.ublk.ids().len(),
        state.display(),
        match errors.len() {
            0 => String::new(),
            n => format!("; {n} errors, see the log"),
        }
    );
    tracing::info!("{line}");
    Ok(line + "\n")
}

/// A thread `name` that hands each connection `listener` accepts to `handle` on
/// a thread `conn` of its own.
fn accept_each(
    name: &str,
    conn: &'static str,
    listener: UnixListener,
    handle: impl Fn(UnixStream) + Clone + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new().name(name.into()).spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { continue };
            let handle = handle.clone();
            let _ = std::thread::Builder::new()
                .name(conn.into())
                .spawn(move || handle(s));
        }
    })?;
    Ok(())
}

/// How a control or door connection ended: a client that went away (and, with
/// `eof_too`, one that sent nothing) is no news; anything else is a line a
/// client caused (rate-limited, `lograte`).
fn connection_ended(what: &str, r: std::io::Result<()>, eof_too: bool) {
    use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
    match r {
        Ok(()) => {}
        Err(e)
            if matches!(e.kind(), BrokenPipe | ConnectionReset) || (eof_too && e.kind() == UnexpectedEof) =>
        {
            tracing::debug!("{what} connection: {e}")
        }
        Err(e) => crate::lograte::client_line(tracing::Level::WARN, &format!("{what} connection: {e}")),
    }
}

/// dmkit's block major for this run directory: the one its `major` file names,
/// else one the kernel never gives out ([`crate::mapper::Major::choose`]),
/// written there. A run directory whose devices were recorded before the file
/// existed keeps 253, the number its tables and nodes were made with.
fn choose_major(run_dir: &Path) -> Result<u32> {
    use crate::mapper::Major;
    let file = run_dir.join(Major::FILE);
    if let Ok(text) = std::fs::read_to_string(&file) {
        let m: u32 = text
            .trim()
            .parse()
            .ok()
            .filter(|m| (1..4096).contains(m))
            .with_context(|| {
                format!(
                    "{}: not a block major number: {:?}",
                    file.display(),
                    crate::table::bounded(&text)
                )
            })?;
        return Ok(m);
    }
    let state = state_path(run_dir);
    let m = if state.exists() || crate::control::state::prev_path(&state).exists() {
        tracing::warn!(
            "{} records devices made with major 253, the kernel's device-mapper major: kept for them \
             (start over in a new run directory to have dmkit's own major)",
            state.display()
        );
        253
    } else {
        let devices = std::fs::read_to_string("/proc/devices").unwrap_or_default();
        Major::choose(&devices).context("every block major from 260 to 511 is taken in /proc/devices")?
    };
    std::fs::write(&file, format!("{m}\n")).with_context(|| format!("writing {}", file.display()))?;
    tracing::info!("dmkit's devices have block major {m} ({})", file.display());
    Ok(m)
}

/// The number of devices a state file records (its `create` requests).
fn recorded_devices(state: &Path) -> usize {
    std::fs::read_to_string(state).map_or(0, |t| {
        crate::control::state::parse(&t)
            .iter()
            .filter(|r| r.first().is_some_and(|v| v == "create"))
            .count()
    })
}

/// Tell systemd the daemon is ready (`Type=notify`): READY=1 to $NOTIFY_SOCKET,
/// a path or an abstract name starting with '@'.
fn notify_systemd() {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(s) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    let r = match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name)
                .and_then(|a| s.send_to_addr(b"READY=1", &a))
        }
        None => s.send_to(b"READY=1", &path),
    };
    if let Err(e) = r {
        tracing::warn!("telling systemd we are ready ({}): {e}", path.to_string_lossy());
    }
}

/// Create sparse demo backing files (on first run) and the demo devices: a thin pool
/// over them, a 1 GiB thin volume and a snapshot of it (made on first run, kept after).
fn demo(reg: &Registry, dir: &Path, nbd_path: &Path, tcp: Option<&str>) -> Result<()> {
    const DATA_BYTES: u64 = 4 << 30;
    const META_BYTES: u64 = 64 << 20;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = dir.canonicalize()?;
    let (meta, data) = (dir.join("pool-meta.img"), dir.join("pool-data.img"));
    let reopened = meta.exists() && data.exists();
    for (f, len) in [(&meta, META_BYTES), (&data, DATA_BYTES)] {
        if !f.exists() {
            std::fs::File::create(f)?.set_len(len)?;
        }
    }
    let pool = format!(
        "0 {} thin-pool {} {} 128 0",
        DATA_BYTES / 512,
        meta.display(),
        data.display()
    );
    reg.create("demo-pool", Some(&pool), false, None)?;
    let thin_sectors = (1u64 << 30) / 512;
    // A thin and a snapshot of it; on later runs they exist already.
    for (msg, name, id) in [
        ("create_thin 0", "demo-thin", 0),
        ("create_snap 1 0", "demo-snap", 1),
    ] {
        let words: Vec<String> = msg.split(' ').map(str::to_string).collect();
        if let Err(e) = reg.message("demo-pool", 0, &words) {
            if !e.to_string().contains("already exists") {
                return Err(e.into());
            }
        }
        let table = format!("0 {thin_sectors} thin /dev/mapper/demo-pool {id}");
        reg.create(name, Some(&table), false, None)?;
    }
    reg.create("demo-zero", Some(&format!("0 {thin_sectors} zero")), false, None)?;
    let sock = nbd_path.display();
    if reopened {
        println!(
            "dmkit demo: reopened the thin pool of an earlier demo in {}, its thin volume and \
             snapshot as they were left (remove the directory to start afresh)",
            dir.display()
        );
    } else {
        println!(
            "dmkit demo: a thin pool over sparse files in {}, a thin volume and its snapshot",
            dir.display()
        );
    }
    println!();
    for name in ["demo-thin", "demo-snap", "demo-zero"] {
        println!("  nbd+unix:///{name}?socket={sock}");
        if let Some(t) = tcp {
            println!("  nbd://{t}/{name}");
        }
    }
    println!();
    println!("Try, in another terminal:");
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("dmkit"));
    let run_dir = nbd_path.parent().unwrap_or(Path::new("."));
    println!("  {} --run-dir {} table", exe.display(), run_dir.display());
    println!("  nbdinfo --list 'nbd+unix:///?socket={sock}'");
    println!("  nbdinfo --map 'nbd+unix:///demo-thin?socket={sock}'        (unprovisioned: holes)");
    println!("  qemu-img convert -n -O raw some.img 'nbd+unix:///demo-thin?socket={sock}'");
    println!("  fio --name=t --ioengine=nbd --uri='nbd+unix:///demo-thin?socket={sock}' --rw=randrw --bs=4k --iodepth=32 --size=256M --runtime=10 --time_based");
    println!(
        "  {} --run-dir {} status demo-pool     (data blocks used)",
        exe.display(),
        run_dir.display()
    );
    println!();
    println!("Ctrl-C stops the daemon (devices are flushed first).");
    Ok(())
}
