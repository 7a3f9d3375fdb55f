//! The engine with mock targets: a request split by its target, parked while a
//! device on its path is suspended and mapped again after the resume, data in
//! buffers a target owns, every end-of-I/O hook told whether its I/O
//! happened, and a request whose only unfinished piece waits in a target
//! holding no device below its own, and a mirror whose failed leg fails only
//! into its hook (`remap_tolerant`) and whose read goes again to the other leg
//! (`REMAP`); a large request's owned-buffer hooks run on a worker thread
//! while the engine serves others.

use super::*;
use crate::mapper::{arg_dev, arg_u64, DevRef, Resolver, TagProfile, Target, TargetType};
use crate::mapper::{config::Config, Registry};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// What each mock device's hooks saw, by the log id in its table: (op, sector, ok).
type Log = Vec<(Op, u64, bool)>;

fn logs() -> &'static Mutex<HashMap<u64, Log>> {
    static LOGS: OnceLock<Mutex<HashMap<u64, Log>>> = OnceLock::new();
    LOGS.get_or_init(Default::default)
}

fn log_of(id: u64) -> Log {
    logs().lock().unpoisoned().get(&id).cloned().unwrap_or_default()
}

/// The threads each mock device's owned-buffer hooks ran on, by log id.
fn hook_threads() -> &'static Mutex<HashMap<u64, Vec<String>>> {
    static THREADS: OnceLock<Mutex<HashMap<u64, Vec<String>>>> = OnceLock::new();
    THREADS.get_or_init(Default::default)
}

fn record(id: u64, op: Op, sector: u64, ok: bool) {
    logs()
        .lock()
        .unpoisoned()
        .entry(id)
        .or_default()
        .push((op, sector, ok));
}

/// `split <dev> <chunk sectors> <log id>`: reads and writes go to `dev` at the
/// same sectors in pieces of `chunk`, each with a hook that logs its outcome.
struct Split {
    dev: DevRef,
    chunk: u64,
    id: u64,
}

const SPLIT: TargetType = TargetType {
    name: "split",
    version: [1, 0, 0],
    new: |args, len, r: &dyn Resolver| {
        Ok(Box::new(Split {
            dev: arg_dev(args, 0, 0, len, r)?,
            chunk: arg_u64(args, 1, "chunk")?.max(1),
            id: arg_u64(args, 2, "log id")?,
        }))
    },
    sync: None,
};

impl Target for Split {
    fn type_name(&self) -> &'static str {
        "split"
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        if !matches!(bio.op, Op::Read | Op::Write) {
            return ctx.remap(&self.dev, bio, 0);
        }
        let mut done = 0;
        while done < bio.nr_sectors {
            let n = self.chunk.min(bio.nr_sectors - done);
            let piece = bio.sub(done, n, bio.sector + done);
            let (id, op, sector) = (self.id, bio.op, piece.sector);
            let hook: EndIo = Arc::new(move |ok, _: &mut [u8]| {
                record(id, op, sector, ok);
                0
            });
            ctx.remap_with(&self.dev, piece, 0, hook)?;
            done += n;
        }
        Ok(())
    }
    fn table_params(&self) -> String {
        format!("{} {} {}", self.dev.table_name(), self.chunk, self.id)
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }
}

/// `invert <dev> <log id>`: data is stored inverted, through buffers of the
/// target's own; the hook logs each outcome.
struct Invert {
    dev: DevRef,
    id: u64,
}

const INVERT: TargetType = TargetType {
    name: "invert",
    version: [1, 0, 0],
    new: |args, len, r: &dyn Resolver| {
        Ok(Box::new(Invert {
            dev: arg_dev(args, 0, 0, len, r)?,
            id: arg_u64(args, 1, "log id")?,
        }))
    },
    sync: None,
};

fn invert(from: &[u8], to: &mut [u8]) {
    for (t, f) in to.iter_mut().zip(from) {
        *t = !f;
    }
}

impl Target for Invert {
    fn type_name(&self) -> &'static str {
        "invert"
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let (id, op, sector) = (self.id, bio.op, bio.sector);
        ctx.remap_owned(
            &self.dev,
            bio,
            |own, client| invert(client, own),
            Some(Box::new(move |ok, own, client| {
                record(id, op, sector, ok);
                let me = std::thread::current().name().unwrap_or("-").to_string();
                hook_threads().lock().unpoisoned().entry(id).or_default().push(me);
                if ok && op == Op::Read {
                    invert(own, client);
                }
                0
            })),
        )
    }
    fn table_params(&self) -> String {
        format!("{} {}", self.dev.table_name(), self.id)
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }
}

/// `wait <dev>`: the first half of a request waits in the target (a piece, kept
/// in `WAITING` for the test to send on), the second half goes to `dev`.
struct Wait {
    dev: DevRef,
}

static WAITING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());

const WAIT: TargetType = TargetType {
    name: "wait",
    version: [1, 0, 0],
    new: |args, len, r: &dyn Resolver| {
        Ok(Box::new(Wait {
            dev: arg_dev(args, 0, 0, len, r)?,
        }))
    },
    sync: None,
};

impl Target for Wait {
    fn type_name(&self) -> &'static str {
        "wait"
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let half = bio.nr_sectors / 2;
        WAITING
            .lock()
            .unpoisoned()
            .push(ctx.submit(bio.sub(0, half, bio.sector)));
        ctx.remap(
            &self.dev,
            bio.sub(half, bio.nr_sectors - half, bio.sector + half),
            0,
        )
    }
    fn table_params(&self) -> String {
        self.dev.table_name()
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }
}

/// `mirror <dev a> <dev b>`: writes go to both legs, tolerantly, and succeed
/// if one did; a read goes to the first leg not known dead, and one that fails
/// marks its leg dead and has the request mapped again.
struct Mirror {
    legs: [DevRef; 2],
    dead: Arc<[AtomicBool; 2]>,
}

const MIRROR: TargetType = TargetType {
    name: "mirror",
    version: [1, 0, 0],
    new: |args, len, r: &dyn Resolver| {
        Ok(Box::new(Mirror {
            legs: [arg_dev(args, 0, 0, len, r)?, arg_dev(args, 1, 0, len, r)?],
            dead: Arc::new([AtomicBool::new(false), AtomicBool::new(false)]),
        }))
    },
    sync: None,
};

impl Target for Mirror {
    fn type_name(&self) -> &'static str {
        "mirror"
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        if bio.op == Op::Read {
            let Some(i) = (0..2).find(|&i| !self.dead[i].load(Ordering::SeqCst)) else {
                return Err(MapErr::Errno(errno::EIO));
            };
            let dead = self.dead.clone();
            return ctx.remap_tolerant(
                &self.legs[i],
                bio,
                0,
                Arc::new(move |ok, _: &mut [u8]| {
                    if ok {
                        return 0;
                    }
                    dead[i].store(true, Ordering::SeqCst);
                    crate::io::REMAP
                }),
            );
        }
        let good = Arc::new(AtomicUsize::new(0));
        let left = Arc::new(AtomicUsize::new(2));
        for leg in &self.legs {
            let (good, left) = (good.clone(), left.clone());
            ctx.remap_tolerant(
                leg,
                bio,
                0,
                Arc::new(move |ok, _: &mut [u8]| {
                    if ok {
                        good.fetch_add(1, Ordering::SeqCst);
                    }
                    if left.fetch_sub(1, Ordering::SeqCst) == 1 && good.load(Ordering::SeqCst) == 0 {
                        return errno::EIO;
                    }
                    0
                }),
            )?;
        }
        Ok(())
    }
    fn table_params(&self) -> String {
        format!("{} {}", self.legs[0].table_name(), self.legs[1].table_name())
    }
    fn devices(&self) -> Vec<&DevRef> {
        self.legs.iter().collect()
    }
}

/// The tags `tagged` and `tagstore` use: 4 bytes a 4 KiB block.
const PROFILE: TagProfile = TagProfile {
    tag_size: 4,
    block_size: 4096,
};

/// A block's tag as `tagged` makes it: its first bytes, flipped.
fn tag_of(block: &[u8]) -> [u8; 4] {
    [!block[0], !block[1], !block[2], !block[3]]
}

/// `tagged <dev> <log id>`: reads and writes go down with a tag for each
/// block (`remap_owned_tagged`); a read whose tags are not its blocks' fails
/// with EILSEQ.
struct Tagged {
    dev: DevRef,
    id: u64,
}

const TAGGED: TargetType = TargetType {
    name: "tagged",
    version: [1, 0, 0],
    new: |args, len, r: &dyn Resolver| {
        Ok(Box::new(Tagged {
            dev: arg_dev(args, 0, 0, len, r)?,
            id: arg_u64(args, 1, "log id")?,
        }))
    },
    sync: None,
};

impl Target for Tagged {
    fn type_name(&self) -> &'static str {
        "tagged"
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let (id, op, sector) = (self.id, bio.op, bio.sector);
        ctx.remap_owned_tagged(
            &self.dev,
            bio,
            Some(PROFILE),
            |own, tags, client| {
                own.copy_from_slice(client);
                for (b, t) in own.chunks(4096).zip(tags.chunks_mut(4)) {
                    t.copy_from_slice(&tag_of(b));
                }
            },
            Some(Box::new(move |ok, own, client| {
                record(id, op, sector, ok);
                if !ok || op != Op::Read {
                    return 0;
                }
                let (data, tags) = own.split_at(client.len());
                if !data.chunks(4096).zip(tags.chunks(4)).all(|(b, t)| t == tag_of(b)) {
                    return libc::EILSEQ;
                }
                client.copy_from_slice(data);
                0
            })),
        )
    }
    fn table_params(&self) -> String {
        format!("{} {}", self.dev.table_name(), self.id)
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }
}

/// Tags by (log id, block).
type TagMap = HashMap<(u64, u64), Vec<u8>>;

/// The tags `tagstore` devices hold.
fn stored_tags() -> &'static Mutex<TagMap> {
    static TAGS: OnceLock<Mutex<TagMap>> = OnceLock::new();
    TAGS.get_or_init(Default::default)
}

/// `tagstore <file> <log id>`: offers [`PROFILE`]; data goes to the file,
/// tags into [`stored_tags`]; a read is a piece done with the data and its
/// tags after it.
struct TagStore {
    file: std::path::PathBuf,
    id: u64,
}

const TAGSTORE: TargetType = TargetType {
    name: "tagstore",
    version: [1, 0, 0],
    new: |args, _, _| {
        Ok(Box::new(TagStore {
            file: args.first().ok_or("a file")?.into(),
            id: arg_u64(args, 1, "log id")?,
        }))
    },
    sync: None,
};

impl Target for TagStore {
    fn type_name(&self) -> &'static str {
        "tagstore"
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.file)
            .expect("file");
        let blocks = bio.sector / 8..(bio.sector + bio.nr_sectors) / 8;
        match bio.op {
            Op::Write => {
                let tags = ctx.tags_of(&bio).expect("a write comes with its tags").to_vec();
                f.write_all_at(ctx.data_of(&bio), bio.sector * 512)
                    .expect("write");
                let mut st = stored_tags().lock().unpoisoned();
                for (b, t) in blocks.zip(tags.chunks(4)) {
                    st.insert((self.id, b), t.to_vec());
                }
                ctx.complete(bio, LeafKind::Drop);
            }
            Op::Read => {
                let mut out = vec![0u8; bio.bytes() as usize];
                f.read_exact_at(&mut out, bio.sector * 512).expect("read");
                let st = stored_tags().lock().unpoisoned();
                for b in blocks {
                    out.extend(st.get(&(self.id, b)).cloned().unwrap_or(vec![0; 4]));
                }
                ctx.submit(bio).done_with(out);
            }
            _ => ctx.complete(bio, LeafKind::Drop),
        }
        Ok(())
    }
    fn table_params(&self) -> String {
        format!("{} {}", self.file.display(), self.id)
    }
    fn tag_profile(&self) -> Option<TagProfile> {
        Some(PROFILE)
    }
}

const TYPES: &[TargetType] = &[
    SPLIT,
    INVERT,
    WAIT,
    MIRROR,
    TAGGED,
    TAGSTORE,
    crate::mapper::error::TYPE,
];

/// A registry knowing the mock targets, and a 1 MiB file of zeroes under it.
fn setup(name: &str) -> (Registry, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("dmkit-engine-{}-{name}", std::process::id()));
    std::fs::write(&path, vec![0u8; 1 << 20]).expect("backing file");
    let reg = Registry::new(
        Config {
            direct_io: false,
            ..Config::default()
        },
        TYPES,
    );
    (reg, path)
}

/// Fill a slot with `op` over `n` sectors at `sector` (`data` for a write).
fn fill(e: &mut Engine, op: Op, sector: u64, n: u64, data: Option<&[u8]>) -> usize {
    let r = e.alloc().expect("a free slot");
    let q = e.request_mut(r);
    q.op = op;
    q.sector = sector;
    q.nr_sectors = n;
    q.fua = false;
    q.buf.ensure((n * 512).max(1) as usize);
    if let Some(d) = data {
        q.buf.as_mut_slice()[..d.len()].copy_from_slice(d);
    }
    r
}

/// Turn the engine until `r` is done (at most `limit` turns): its error.
fn wait(e: &mut Engine, r: usize, limit: u32) -> Option<i32> {
    for _ in 0..limit {
        if let Some(d) = e.pop_done() {
            assert_eq!(d, r, "another request completed");
            return Some(e.request(r).error);
        }
        e.turn(Some(Duration::from_millis(2))).expect("turn");
    }
    None
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

#[test]
fn a_request_split_by_its_target_lands_and_every_hook_learns_it_happened() {
    let (reg, path) = setup("split");
    reg.create(
        "s",
        Some(&format!("0 2048 split {} 8 101", path.display())),
        false,
        None,
    )
    .expect("create");
    let dev = reg.get("s").expect("s");
    let mut e = Engine::new(4).expect("engine");
    let data = pattern(64 << 10, 7);
    let r = fill(&mut e, Op::Write, 16, 128, Some(&data));
    e.start(r, &dev);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    e.free(r);
    let on_disk = std::fs::read(&path).expect("read back");
    assert_eq!(&on_disk[16 * 512..16 * 512 + data.len()], &data[..]);
    let log = log_of(101);
    assert_eq!(log.len(), 16, "one hook per 8-sector piece: {log:?}");
    assert!(log.iter().all(|&(op, _, ok)| op == Op::Write && ok));
    let r = fill(&mut e, Op::Read, 16, 128, None);
    e.start(r, &dev);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    assert_eq!(&e.request(r).buf.as_slice()[..data.len()], &data[..]);
    e.free(r);
    e.shut_down();
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_failed_leaf_fails_the_request_and_its_hook_learns_it() {
    let (reg, path) = setup("fail");
    reg.create("bad", Some("0 2048 error"), false, None)
        .expect("error device");
    reg.create("s", Some("0 2048 split /dev/mapper/bad 4 102"), false, None)
        .expect("create");
    let dev = reg.get("s").expect("s");
    let mut e = Engine::new(1).expect("engine");
    let r = fill(&mut e, Op::Write, 0, 8, Some(&[1; 4096]));
    e.start(r, &dev);
    assert_eq!(wait(&mut e, r, 1000), Some(errno::EIO));
    let log = log_of(102);
    assert_eq!(log.len(), 2, "{log:?}");
    assert!(log.iter().all(|&(_, _, ok)| !ok), "{log:?}");
    e.free(r);
    e.shut_down();
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_request_waits_while_a_lower_device_is_suspended_and_is_mapped_again_once() {
    let (reg, path) = setup("suspend");
    reg.create(
        "low",
        Some(&format!("0 2048 split {} 8 103", path.display())),
        false,
        None,
    )
    .expect("low");
    reg.create("top", Some("0 2048 invert /dev/mapper/low 104"), false, None)
        .expect("top");
    let (top, low) = (reg.get("top").expect("top"), reg.get("low").expect("low"));
    let mut e = Engine::new(4).expect("engine");
    reg.suspend("low", false).expect("suspend");
    let data = pattern(16 << 10, 3);
    let r = fill(&mut e, Op::Write, 64, 32, Some(&data));
    e.start(r, &top);
    assert_eq!(
        wait(&mut e, r, 50),
        None,
        "done while its lower device is suspended"
    );
    // a request straight to the lower device waits too, and one to a device
    // that is not suspended goes past both
    let r2 = fill(&mut e, Op::Read, 0, 8, None);
    e.start(r2, &low);
    reg.create(
        "other",
        Some(&format!("0 8 split {} 8 105", path.display())),
        false,
        None,
    )
    .expect("other");
    let other = reg.get("other").expect("other");
    let r3 = fill(&mut e, Op::Read, 0, 8, None);
    e.start(r3, &other);
    assert_eq!(wait(&mut e, r3, 1000), Some(0), "a request to another device");
    e.free(r3);
    // what a request that takes long is logged with says why it waits
    let why = e.describe(r2);
    assert!(
        why.starts_with("Parked Read 0+8 on low (suspended true): pending 0"),
        "{why}"
    );
    assert!(why.contains("parked 2"), "{why}");
    let before = log_of(104);
    assert!(
        before.iter().all(|&(_, _, ok)| !ok),
        "mapping stopped at the suspended device: the owned buffer's hook learns it: {before:?}"
    );
    assert!(log_of(103).is_empty(), "nothing reached the suspended device");
    reg.resume("low").expect("resume");
    let mut done = Vec::new();
    for _ in 0..1000 {
        if done.len() == 2 {
            break;
        }
        done.extend(std::iter::from_fn(|| e.pop_done()));
        e.turn(Some(Duration::from_millis(2))).expect("turn");
    }
    done.sort_unstable();
    assert_eq!(done, vec![r.min(r2), r.max(r2)], "both done after the resume");
    assert_eq!((e.request(r).error, e.request(r2).error), (0, 0));
    e.free(r);
    e.free(r2);
    // stored inverted exactly once, though mapped twice
    let on_disk = std::fs::read(&path).expect("read back");
    let stored = &on_disk[64 * 512..64 * 512 + data.len()];
    assert!(
        stored.iter().zip(&data).all(|(s, d)| *s == !d),
        "stored inverted once"
    );
    let after = log_of(104);
    assert_eq!(after.len(), before.len() + 1, "{after:?}");
    assert_eq!(after.last(), Some(&(Op::Write, 64, true)));
    assert_eq!(log_of(103).iter().filter(|l| l.0 == Op::Write && l.2).count(), 4);
    // and reads back as written, through the owned buffer
    let r = fill(&mut e, Op::Read, 64, 32, None);
    e.start(r, &top);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    assert_eq!(&e.request(r).buf.as_slice()[..data.len()], &data[..]);
    e.free(r);
    e.forget_devices();
    e.shut_down();
    drop(e);
    // the engine holds no device once its slots forgot them
    assert_eq!(Arc::strong_count(&top), 2, "the registry's and ours");
    let _ = std::fs::remove_file(path);
}

/// A request whose only unfinished part is a piece waiting in its target holds
/// its own device but none below it, so a lower device can drain (a thin pool's
/// discard waits for that while the piece waits for the discard); the piece
/// going on enters the lower device again.
#[test]
fn a_request_with_only_a_waiting_piece_left_holds_no_lower_device() {
    let (reg, path) = setup("relax");
    reg.create(
        "low",
        Some(&format!("0 2048 split {} 8 106", path.display())),
        false,
        None,
    )
    .expect("low");
    reg.create("top", Some("0 2048 wait /dev/mapper/low"), false, None)
        .expect("top");
    let (top, low) = (reg.get("top").expect("top"), reg.get("low").expect("low"));
    let mut e = Engine::new(4).expect("engine");
    let data = pattern(16 << 10, 5);
    let r = fill(&mut e, Op::Write, 128, 32, Some(&data));
    e.start(r, &top);
    for _ in 0..1000 {
        if log_of(106).len() == 2 {
            break;
        }
        e.turn(Some(Duration::from_millis(2))).expect("turn");
    }
    assert_eq!(log_of(106).len(), 2, "the second half's leaves");
    assert!(e.pop_done().is_none(), "done with a piece still waiting");
    assert_eq!(
        (top.in_flight(), low.in_flight()),
        (1, 0),
        "in flight in top and low"
    );
    assert!(low.drain_epoch(Duration::from_millis(100)), "low drains");
    let p = WAITING.lock().unpoisoned().pop().expect("the waiting piece");
    let bio = p.bio();
    p.remap(Dest::Dm(low.clone()), bio, None);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    assert_eq!((top.in_flight(), low.in_flight()), (0, 0));
    assert_eq!(log_of(106).len(), 4, "the first half went on through low");
    e.free(r);
    let on_disk = std::fs::read(&path).expect("read back");
    assert_eq!(&on_disk[128 * 512..128 * 512 + data.len()], &data[..]);
    e.forget_devices();
    e.shut_down();
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_mirror_survives_a_failed_leg_and_reads_again_from_the_other() {
    let (reg, path) = setup("mirror");
    reg.create("dead", Some("0 2048 error"), false, None)
        .expect("error device");
    reg.create(
        "m",
        Some(&format!("0 2048 mirror /dev/mapper/dead {}", path.display())),
        false,
        None,
    )
    .expect("create");
    reg.create(
        "both",
        Some("0 2048 mirror /dev/mapper/dead /dev/mapper/dead"),
        false,
        None,
    )
    .expect("create");
    let (m, both) = (reg.get("m").expect("m"), reg.get("both").expect("both"));
    let mut e = Engine::new(1).expect("engine");
    let data = pattern(8192, 3);
    // the write fails on the dead leg only: the request succeeds
    let r = fill(&mut e, Op::Write, 8, 16, Some(&data));
    e.start(r, &m);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    e.free(r);
    assert_eq!(
        &std::fs::read(&path).expect("read back")[8 * 512..8 * 512 + 8192],
        &data[..]
    );
    // the read goes to the dead leg first, fails there, and is mapped again
    let r = fill(&mut e, Op::Read, 8, 16, None);
    e.start(r, &m);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    assert_eq!(&e.request(r).buf.as_slice()[..8192], &data[..]);
    e.free(r);
    // with both legs dead, the write and the read fail
    let r = fill(&mut e, Op::Write, 0, 8, Some(&[1; 4096]));
    e.start(r, &both);
    assert_eq!(wait(&mut e, r, 1000), Some(errno::EIO));
    e.free(r);
    let r = fill(&mut e, Op::Read, 0, 8, None);
    e.start(r, &both);
    assert_eq!(wait(&mut e, r, 1000), Some(errno::EIO));
    e.free(r);
    e.shut_down();
    let _ = std::fs::remove_file(path);
}

/// A request with 256 KiB or more of owned-buffer hooks (two inverts, one over
/// the other) has them run on a worker when the engine offloads: innermost
/// first (the data comes back inverted twice), the request completing from the
/// worker's answer, while a small request beside it has its hooks run on the
/// engine's thread; a failure below still reaches the hooks and the request;
/// the engine shuts down only once the worker's answer is back.
#[test]
fn a_large_requests_hooks_run_on_a_worker_and_the_request_completes_from_its_answer() {
    let (reg, path) = setup("offload");
    reg.create(
        "in",
        Some(&format!("0 2048 invert {} 110", path.display())),
        false,
        None,
    )
    .expect("in");
    reg.create("out", Some("0 2048 invert /dev/mapper/in 111"), false, None)
        .expect("out");
    reg.create("bad", Some("0 2048 error"), false, None).expect("bad");
    reg.create("badinv", Some("0 2048 invert /dev/mapper/bad 112"), false, None)
        .expect("badinv");
    let out = reg.get("out").expect("out");
    let mut e = Engine::new(4).expect("engine");
    e.offload_hooks(true);
    let data = pattern(512 << 10, 5);
    let r = fill(&mut e, Op::Write, 0, 1024, Some(&data));
    e.start(r, &out);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    e.free(r);
    // inverted twice on the way down: stored as written
    let on_disk = std::fs::read(&path).expect("read back");
    assert_eq!(&on_disk[..data.len()], &data[..]);
    let big = fill(&mut e, Op::Read, 0, 1024, None);
    e.start(big, &out);
    let small = fill(&mut e, Op::Read, 1024, 8, None);
    e.start(small, &out);
    let mut done = Vec::new();
    for _ in 0..1000 {
        if done.len() == 2 {
            break;
        }
        done.extend(std::iter::from_fn(|| e.pop_done()));
        e.turn(Some(Duration::from_millis(2))).expect("turn");
    }
    assert_eq!(done.len(), 2, "both reads done: {done:?}");
    assert!(done.contains(&big) && done.contains(&small), "{done:?}");
    assert_eq!((e.request(big).error, e.request(small).error), (0, 0));
    assert_eq!(&e.request(big).buf.as_slice()[..data.len()], &data[..]);
    assert_eq!(&e.request(small).buf.as_slice()[..4096], &[0u8; 4096][..]);
    e.free(big);
    e.free(small);
    let threads = hook_threads().lock().unpoisoned().clone();
    for id in [110, 111] {
        let t = &threads[&id];
        // the write's hook and the large read's on workers, the small read's
        // here (in either order: the small read may finish first)
        assert_eq!(t.len(), 3, "{id}: {t:?}");
        let on_workers = t.iter().filter(|n| n.starts_with("dm-hooks-")).count();
        assert_eq!(on_workers, 2, "{id}: {t:?}");
    }
    let (li, lo) = (log_of(110), log_of(111));
    assert_eq!((li.len(), lo.len()), (3, 3), "{li:?} {lo:?}");
    assert!(li.iter().chain(&lo).all(|&(_, _, ok)| ok));
    // a failure below reaches the hook and fails the request
    let bad = reg.get("badinv").expect("badinv");
    let r = fill(&mut e, Op::Read, 0, 1024, None);
    e.start(r, &bad);
    assert_eq!(wait(&mut e, r, 1000), Some(errno::EIO));
    e.free(r);
    assert_eq!(log_of(112), vec![(Op::Read, 0, false)]);
    assert!(hook_threads().lock().unpoisoned()[&112][0].starts_with("dm-hooks-"));
    // a request whose hooks are out holds the shut-down until they are back
    let r = fill(&mut e, Op::Read, 0, 1024, None);
    e.start(r, &out);
    e.shut_down();
    assert!(!e.busy(), "nothing under way after the shut-down");
    let _ = std::fs::remove_file(path);
}

/// Tags go down with their blocks through a target that splits the request
/// (each piece's tags where its blocks' are: `Bio::sub`), are stored below,
/// and come back with a read into the owned buffer's tag area, where the
/// hook above checks them; a stored tag changed fails that read with EILSEQ.
/// A device above sees the profile of the device below only through a
/// target that says it passes tags (`split` does not).
#[test]
fn integrity_tags_go_down_with_their_blocks_and_come_back_with_a_read() {
    let (reg, path) = setup("tags");
    reg.create(
        "store",
        Some(&format!("0 2048 tagstore {} 107", path.display())),
        false,
        None,
    )
    .expect("store");
    reg.create("split", Some("0 2048 split /dev/mapper/store 8 108"), false, None)
        .expect("split");
    reg.create("top", Some("0 2048 tagged /dev/mapper/split 109"), false, None)
        .expect("top");
    let profile = |n: &str| reg.get(n).expect(n).tag_profile();
    assert_eq!((profile("store"), profile("split")), (Some(PROFILE), None));
    let top = reg.get("top").expect("top");
    let mut e = Engine::new(4).expect("engine");
    let data = pattern(64 << 10, 9);
    let r = fill(&mut e, Op::Write, 64, 128, Some(&data));
    e.start(r, &top);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    e.free(r);
    {
        let st = stored_tags().lock().unpoisoned();
        for (i, b) in data.chunks(4096).enumerate() {
            assert_eq!(
                st.get(&(107, 8 + i as u64)).map(Vec::as_slice),
                Some(&tag_of(b)[..]),
                "block {i}'s tag"
            );
        }
    }
    let r = fill(&mut e, Op::Read, 64, 128, None);
    e.start(r, &top);
    assert_eq!(wait(&mut e, r, 1000), Some(0));
    assert_eq!(&e.request(r).buf.as_slice()[..data.len()], &data[..]);
    e.free(r);
    stored_tags().lock().unpoisoned().insert((107, 12), vec![0; 4]);
    let r = fill(&mut e, Op::Read, 64, 128, None);
    e.start(r, &top);
    assert_eq!(
        wait(&mut e, r, 1000),
        Some(libc::EILSEQ),
        "a changed tag fails the read"
    );
    e.free(r);
    assert!(log_of(109).iter().all(|&(_, _, ok)| ok), "every I/O happened");
    e.shut_down();
    let _ = std::fs::remove_file(path);
}
