//! Replaying a dm-log-writes log ([`super::format`]) onto a file or block
//! device: every entry in order, up to the end, a mark, an entry or a flush; and
//! the states a crash could have left ([`crash_states`]). Discards are replayed
//! as zeroes (what a device that discards deterministically reads back; a
//! replay must not depend on the target's discard support).

use super::format::{Entry, Super, DISCARD, ENTRY_LEN, FLUSH, FUA, MARK};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Why a replay, a crash-state enumeration or a check stopped: one line that
/// says what and where (the log entry, the target, the check command), for the
/// command line to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayError(String);

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReplayError {}

impl From<String> for ReplayError {
    fn from(s: String) -> ReplayError {
        ReplayError(s)
    }
}

impl From<&str> for ReplayError {
    fn from(s: &str) -> ReplayError {
        ReplayError(s.to_string())
    }
}

impl From<crate::mapper::TargetError> for ReplayError {
    fn from(e: crate::mapper::TargetError) -> ReplayError {
        ReplayError(e.to_string())
    }
}

/// Where a replay stops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Until {
    /// Every entry the super counts.
    End,
    /// Through the first mark with this text.
    Mark(String),
    /// The first N entries.
    Entry(u64),
    /// Through the N-th flush entry (from 1).
    Flush(u64),
}

impl Until {
    /// `mark:NAME`, `entry:N` or `flush:N`.
    pub fn parse(s: &str) -> Result<Until, ReplayError> {
        let num = |v: &str, what: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("--until {what}:{v}: not a number"))
        };
        match s.split_once(':') {
            Some(("mark", name)) if !name.is_empty() => Ok(Until::Mark(name.to_string())),
            Some(("entry", n)) => Ok(Until::Entry(num(n, "entry")?)),
            Some(("flush", n)) => match num(n, "flush")? {
                0 => Err("--until flush:0: flushes count from 1".into()),
                n => Ok(Until::Flush(n)),
            },
            _ => Err(format!(
                "--until {}: one of mark:NAME, entry:N, flush:N",
                crate::table::bounded(s)
            ).into()),
        }
    }
}

impl Until {
    /// Whether entry `e`, counted in `seen`, is where this stop is.
    fn is_at(&self, e: &LogEntry, seen: &Replayed) -> bool {
        match self {
            Until::End => false,
            Until::Mark(m) => e.mark.as_deref() == Some(m.as_str()),
            Until::Entry(n) => seen.entries >= *n,
            Until::Flush(n) => e.is_flush() && seen.flushes >= *n,
        }
    }
}

/// After which entries a replay runs its check (`--check-at`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckAt {
    /// Each FUA write: what a file system's journal commits with.
    Fua,
    /// Each flush.
    Flush,
    /// Each mark.
    Mark,
    /// Every entry.
    Entry,
}

impl CheckAt {
    pub fn parse(s: &str) -> Result<CheckAt, ReplayError> {
        match s {
            "fua" => Ok(CheckAt::Fua),
            "flush" => Ok(CheckAt::Flush),
            "mark" => Ok(CheckAt::Mark),
            "entry" => Ok(CheckAt::Entry),
            _ => Err(format!(
                "--check-at {}: one of fua, flush, mark, entry",
                crate::table::bounded(s)
            ).into()),
        }
    }

    /// Its word, as `--check-at` takes it.
    pub fn name(self) -> &'static str {
        match self {
            CheckAt::Fua => "fua",
            CheckAt::Flush => "flush",
            CheckAt::Mark => "mark",
            CheckAt::Entry => "entry",
        }
    }

    fn matches(self, e: &LogEntry) -> bool {
        match self {
            CheckAt::Fua => e.is_write() && e.entry.flags & FUA != 0,
            CheckAt::Flush => e.is_flush(),
            CheckAt::Mark => e.mark.is_some(),
            CheckAt::Entry => true,
        }
    }
}

/// A replay's check: `judge` after each entry `at` names, from the entry
/// `from` names on (None: the first).
pub struct Checks<'a> {
    pub judge: &'a mut Judge,
    pub at: CheckAt,
    pub from: Option<Until>,
}

/// Who judges a state built on the target.
pub enum Judge {
    /// A shell command run for each state (`sh -c`, `{}` replaced by the
    /// target's path): exit 0 accepts (`--check`).
    Each(String),
    /// A shell command started once, asked about each state in turn: it reads
    /// a line, the target's path, on its standard input and answers a line on
    /// its standard output, `ok` to accept; any other line refuses the state
    /// and says why (`--judge`). No process is started per state, so a state
    /// costs what building it costs and the judge's own work.
    Serve(Server),
}

/// A judge process of [`Judge::Serve`].
pub struct Server {
    cmd: String,
    child: std::process::Child,
    /// None once closed (at the end, so the judge can end).
    input: Option<std::process::ChildStdin>,
    output: std::io::BufReader<std::process::ChildStdout>,
}

/// The longest answer read from a judge: the rest of a longer line is cut.
const MAX_ANSWER: u64 = 4096;

impl Judge {
    /// Start `cmd` as a judge of [`Judge::Serve`].
    pub fn serve(cmd: &str) -> Result<Judge, ReplayError> {
        use std::process::{Command, Stdio};
        let mut child = Command::new("sh")
            .args(["-c", cmd])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the judge: {e}"))?;
        let (input, output) = (child.stdin.take(), child.stdout.take());
        match (input, output) {
            (Some(input), Some(output)) => Ok(Judge::Serve(Server {
                cmd: cmd.to_string(),
                child,
                input: Some(input),
                output: std::io::BufReader::new(output),
            })),
            _ => Err("starting the judge: no pipes to it".into()),
        }
    }

    /// The state on the target named `tname`: None accepted, Some(why) refused.
    fn judge(&mut self, tname: &str) -> Result<Option<String>, ReplayError> {
        match self {
            Judge::Each(check) => {
                let res = std::process::Command::new("sh")
                    .args(["-c", &check.replace("{}", tname)])
                    .stdin(std::process::Stdio::null())
                    .output()
                    .map_err(|e| format!("running the check: {e}"))?;
                if res.status.success() {
                    return Ok(None);
                }
                let said = String::from_utf8_lossy(&res.stdout).into_owned() + &String::from_utf8_lossy(&res.stderr);
                Ok(Some(format!(
                    "{}; it said: {}",
                    res.status,
                    crate::table::bounded(said.trim())
                )))
            }
            Judge::Serve(j) => j.ask(tname),
        }
    }
}

impl Server {
    fn ask(&mut self, tname: &str) -> Result<Option<String>, ReplayError> {
        use std::io::{BufRead, Read};
        if tname.contains('\n') {
            return Err(format!("--judge: the target's path has a newline: {}", crate::table::bounded(tname)).into());
        }
        let ended = |s: &mut Server, what: &str| {
            let status = s.child.try_wait().ok().flatten();
            format!(
                "the judge '{}' {what}{}",
                crate::table::bounded(&s.cmd),
                status.map(|st| format!(" ({st})")).unwrap_or_default()
            )
        };
        let sent = match self.input.as_mut() {
            Some(i) => i.write_all(format!("{tname}\n").as_bytes()).and_then(|()| i.flush()),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        if sent.is_err() {
            return Err(ended(self, "stopped reading its questions").into());
        }
        let mut line = Vec::new();
        let n = (&mut self.output)
            .take(MAX_ANSWER)
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("reading the judge's answer: {e}"))?;
        if n == 0 {
            return Err(ended(self, "ended without answering").into());
        }
        if line.last() != Some(&b'\n') {
            // the rest of an overlong line is not the next answer
            let mut rest = Vec::new();
            let _ = self.output.read_until(b'\n', &mut rest);
        }
        let answer = String::from_utf8_lossy(&line);
        match answer.trim_end() {
            "ok" => Ok(None),
            a => Ok(Some(format!("the judge answered: {}", crate::table::bounded(a)))),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // its input closed, a judge that reads to the end ends
        self.input = None;
        let _ = self.child.wait();
    }
}

impl std::fmt::Display for Until {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Until::End => write!(f, "the end"),
            Until::Mark(m) => write!(f, "mark:{}", crate::table::bounded(m)),
            Until::Entry(n) => write!(f, "entry:{n}"),
            Until::Flush(n) => write!(f, "flush:{n}"),
        }
    }
}

/// One entry of a log, checked against the log's size: what it does and where
/// its data is.
#[derive(Clone, Debug)]
pub struct LogEntry {
    pub index: u64,
    pub entry: Entry,
    /// Byte offset and length on the device (in bytes, from the log's blocks).
    pub at: u64,
    pub bytes: u64,
    /// Where its data starts in the log (writes only).
    pub data_at: Option<u64>,
    pub mark: Option<String>,
}

impl LogEntry {
    pub fn is_write(&self) -> bool {
        self.data_at.is_some()
    }
    pub fn is_discard(&self) -> bool {
        self.mark.is_none() && self.entry.flags & DISCARD != 0
    }
    pub fn is_flush(&self) -> bool {
        self.entry.flags & FLUSH != 0
    }

    /// One line for `--list`.
    pub fn describe(&self) -> String {
        let e = &self.entry;
        format!(
            "{} {} sector {} count {}{}",
            self.index,
            e.flag_names(),
            e.sector,
            e.nr_sectors,
            self.mark.as_deref().map(|m| format!(" {m}")).unwrap_or_default()
        )
    }
}

/// A log opened for reading, its super checked.
pub struct LogReader {
    name: String,
    file: File,
    len: u64,
    ss: u64,
    count: u64,
    next: u64,
    pos: u64,
    block: Vec<u8>,
}

impl LogReader {
    pub fn open(log: &Path) -> Result<LogReader, ReplayError> {
        let name = log.display().to_string();
        let file = File::open(log).map_err(|e| format!("{name}: {e}"))?;
        let len = {
            use std::io::{Seek, SeekFrom};
            (&file).seek(SeekFrom::End(0)).map_err(|e| format!("{name}: {e}"))?
        };
        let mut head = [0u8; 28];
        file.read_exact_at(&mut head, 0)
            .map_err(|e| format!("{name}: reading the super: {e}"))?;
        let sup = Super::decode(&head).map_err(|e| format!("{name}: {e}"))?;
        let ss = u64::from(sup.sectorsize);
        if sup.nr_entries > len / ss {
            return Err(format!(
                "{name}: the super counts {} entries, more than the log's {len} bytes can hold",
                sup.nr_entries
            ).into());
        }
        Ok(LogReader {
            name,
            file,
            len,
            ss,
            count: sup.nr_entries,
            next: 0,
            pos: ss,
            block: vec![0u8; ss as usize],
        })
    }

    /// The next entry, None after the last the super counts.
    pub fn next_entry(&mut self) -> Result<Option<LogEntry>, ReplayError> {
        if self.next == self.count {
            return Ok(None);
        }
        let (i, pos, ss, len, name) = (self.next, self.pos, self.ss, self.len, &self.name);
        if pos.checked_add(ss).is_none_or(|end| end > len) {
            return Err(format!("{name}: entry {i} at byte {pos} lies past the log's end ({len})").into());
        }
        self.file
            .read_exact_at(&mut self.block, pos)
            .map_err(|e| format!("{name}: entry {i} at byte {pos}: {e}"))?;
        let e = Entry::decode(&self.block).map_err(|x| format!("{name}: entry {i} at byte {pos}: {x}"))?;
        let bytes = e
            .nr_sectors
            .checked_mul(ss)
            .ok_or_else(|| format!("{name}: entry {i} at byte {pos}: {} blocks overflow", e.nr_sectors))?;
        let at = e
            .sector
            .checked_mul(ss)
            .filter(|a| a.checked_add(bytes).is_some())
            .ok_or_else(|| format!("{name}: entry {i} at byte {pos}: sector {} overflows", e.sector))?;
        let mark = if e.flags & MARK != 0 {
            if e.data_len > ss - ENTRY_LEN as u64 {
                return Err(format!(
                    "{name}: entry {i} at byte {pos}: a mark of {} bytes does not fit its block",
                    e.data_len
                ).into());
            }
            let text = &self.block[ENTRY_LEN..ENTRY_LEN + e.data_len as usize];
            Some(String::from_utf8_lossy(text).into_owned())
        } else {
            None
        };
        let has_data = mark.is_none() && e.flags & DISCARD == 0 && e.nr_sectors > 0;
        let data_at = pos + ss;
        if has_data && data_at.checked_add(bytes).is_none_or(|end| end > len) {
            return Err(format!(
                "{name}: entry {i} at byte {pos}: its {bytes} bytes of data lie past the log's end ({len})"
            ).into());
        }
        self.next += 1;
        self.pos = if has_data { data_at + bytes } else { data_at };
        Ok(Some(LogEntry {
            index: i,
            entry: e,
            at,
            bytes,
            data_at: has_data.then_some(data_at),
            mark,
        }))
    }

    /// Write entry `e` onto `target` (`tname` names it in errors): a write's data,
    /// or zeroes for a discard; nothing for the others. `buf` bounds the copy.
    pub fn apply(&self, e: &LogEntry, target: &File, tname: &str, buf: &mut [u8]) -> Result<(), ReplayError> {
        if !e.is_write() && !e.is_discard() {
            return Ok(());
        }
        let mut done = 0u64;
        while done < e.bytes {
            let n = (e.bytes - done).min(buf.len() as u64) as usize;
            match e.data_at {
                Some(d) => self
                    .file
                    .read_exact_at(&mut buf[..n], d + done)
                    .map_err(|err| format!("{}: entry {}'s data: {err}", self.name, e.index))?,
                None => buf[..n].fill(0),
            }
            target
                .write_all_at(&buf[..n], e.at + done)
                .map_err(|err| format!("{tname}: entry {} at byte {}: {err}", e.index, e.at + done))?;
            done += n as u64;
        }
        Ok(())
    }
}

/// What a replay did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    pub entries: u64,
    pub writes: u64,
    pub discards: u64,
    pub flushes: u64,
    pub marks: u64,
    /// The stop was reached (false: the log ended first).
    pub reached: bool,
    /// States the check accepted.
    pub checked: u64,
    /// The first state the check refused: where, what it said, and the
    /// command that rebuilds it.
    pub failed: Option<String>,
}

impl Replayed {
    fn count(&mut self, e: &LogEntry) {
        self.entries += 1;
        if e.mark.is_some() {
            self.marks += 1;
        } else if e.is_discard() {
            self.discards += 1;
        } else if e.is_write() {
            self.writes += 1;
        }
        if e.is_flush() {
            self.flushes += 1;
        }
    }
}

/// The copy buffer's size: data is copied through it whatever an entry claims.
const BUF: usize = 1 << 20;

fn open_target(t: &Path) -> Result<File, ReplayError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t)
        .map_err(|e| format!("{}: {e}", t.display())).map_err(ReplayError::from)
}

/// Replay `log` onto `target` (None: only list) until `until`, then the entries
/// `with` (indexes past the stop, in order: a crash state [`crash_states`]
/// names); each entry is described on `list` when given. With `checks` (and a
/// target), the check runs on the target after each entry it names up to the
/// stop, and the replay ends at the first state it refuses.
pub fn replay(
    log: &Path,
    target: Option<&Path>,
    until: &Until,
    with: &[u64],
    mut list: Option<&mut dyn Write>,
    mut checks: Option<&mut Checks>,
) -> Result<Replayed, ReplayError> {
    let mut r = LogReader::open(log)?;
    let tf = target.map(open_target).transpose()?;
    let tname = target.map(|t| t.display().to_string()).unwrap_or_default();
    let mut out = Replayed::default();
    let mut buf = vec![0u8; BUF];
    let mut stopped = matches!(until, Until::Entry(0));
    let mut checking = checks.as_ref().is_some_and(|c| c.from.is_none());
    while let Some(e) = r.next_entry()? {
        let apply = if stopped {
            with.contains(&e.index)
        } else {
            if let Some(w) = list.as_deref_mut() {
                let _ = writeln!(w, "{}", e.describe());
            }
            out.count(&e);
            stopped = until.is_at(&e, &out);
            true
        };
        if let (true, Some(t)) = (apply, &tf) {
            r.apply(&e, t, &tname, &mut buf)?;
        }
        if let (false, Some(c), Some(_)) = (with.contains(&e.index), checks.as_deref_mut(), &tf) {
            if checking && c.at.matches(&e) {
                if let Some(why) = c.judge.judge(&tname)? {
                    out.failed = Some(format!(
                        "the check refused the state after entry {} ({}): {why}\n  rebuild it: dmkit replay {} IMAGE --until entry:{}",
                        e.index,
                        e.describe(),
                        log.display(),
                        e.index + 1
                    ));
                    break;
                }
                out.checked += 1;
            }
            checking |= c.from.as_ref().is_some_and(|f| f.is_at(&e, &out));
        }
        if stopped && with.iter().all(|&i| i <= e.index) {
            break;
        }
    }
    out.reached = stopped || matches!(until, Until::End);
    if let Some(t) = &tf {
        t.sync_all().map_err(|e| format!("syncing the target: {e}"))?;
    }
    Ok(out)
}

/// How [`crash_states`] went.
#[derive(Debug, Default)]
pub struct Checked {
    pub states: u64,
    pub epochs: u64,
    /// Epochs whose states were too many to try all and were sampled.
    pub sampled: u64,
    /// The first state the check refused: its description, with the command that
    /// rebuilds it.
    pub failed: Option<String>,
}

/// Every state a crash could have left, checked: for each flush epoch (the
/// writes logged between two flushes, and after the last), the device as it
/// was at the flush before, plus any subset of the epoch's writes and discards
/// and any prefix of its FUA writes (a FUA write is durable once it completed,
/// and they are logged as they complete); all of them when there are at most
/// `max_states`, else `max_states` chosen with `seed` (the empty and the full
/// state always among them). `target` holds the device as it was before the
/// log began (zeroes for a new device) and is left at the last flush's state;
/// each state is built on it by writing the chosen entries and undoing them
/// after `judge` has judged it. Stops at the first state refused.
pub fn crash_states(
    log: &Path,
    target: &Path,
    judge: &mut Judge,
    seed: u64,
    max_states: u64,
) -> Result<Checked, ReplayError> {
    let mut r = LogReader::open(log)?;
    let tf = open_target(target)?;
    let tname = target.display().to_string();
    let mut buf = vec![0u8; BUF];
    let mut out = Checked::default();
    let mut epoch: Vec<LogEntry> = Vec::new();
    // the index of the flush the current epoch follows (None: the log's start)
    let mut after: Option<u64> = None;
    let mut rng = crate::rng::XorShift::seeded(seed | 1);
    loop {
        let e = r.next_entry()?;
        let end = e.as_ref().is_none_or(LogEntry::is_flush);
        if let Some(e) = &e {
            if !e.is_flush() && (e.is_write() || e.is_discard()) {
                if epoch.len() >= MAX_EPOCH {
                    return Err(format!(
                        "{}: more than {MAX_EPOCH} writes between two flushes (entry {}): too many to enumerate",
                        log.display(),
                        e.index
                    ).into());
                }
                epoch.push(e.clone());
            }
        }
        if end {
            out.epochs += 1;
            let mut ctx = Epoch {
                r: &r,
                tf: &tf,
                tname: &tname,
                log: &log.display().to_string(),
                entries: &epoch,
                after,
                judge: &mut *judge,
            };
            if let Some(f) = ctx.check(&mut rng, max_states, &mut buf, &mut out)? {
                out.failed = Some(f);
                return Ok(out);
            }
            // the state at this flush: every entry of the epoch
            for w in &epoch {
                r.apply(w, &tf, &tname, &mut buf)?;
            }
            epoch.clear();
            match e {
                Some(e) => after = Some(e.index),
                None => break,
            }
        }
    }
    tf.sync_all().map_err(|e| format!("syncing {tname}: {e}"))?;
    Ok(out)
}

/// Writes one epoch may hold for [`crash_states`] (their descriptions are kept).
const MAX_EPOCH: usize = 1 << 20;
/// Bytes one state may change (what is saved to undo it).
const MAX_STATE_BYTES: u64 = 1 << 30;

/// One flush epoch of [`crash_states`], and where its states are built.
struct Epoch<'a> {
    r: &'a LogReader,
    tf: &'a File,
    tname: &'a str,
    log: &'a str,
    entries: &'a [LogEntry],
    /// The flush entry the epoch follows (None: the log's start).
    after: Option<u64>,
    judge: &'a mut Judge,
}

impl Epoch<'_> {
    /// Try the epoch's states; Some(description) of the first refused.
    fn check(
        &mut self,
        rng: &mut crate::rng::XorShift,
        max_states: u64,
        buf: &mut [u8],
        out: &mut Checked,
    ) -> Result<Option<String>, ReplayError> {
        let (r, tf, tname, epoch, after) = (self.r, self.tf, self.tname, self.entries, self.after);
        let (fua, plain): (Vec<&LogEntry>, Vec<&LogEntry>) = epoch.iter().partition(|e| e.entry.flags & FUA != 0);
        let n = plain.len() as u32;
        // states: a subset of `plain` (a bit each) and a prefix of `fua`
        let states = Self::states(n, fua.len(), max_states, rng, out);
        for (set, k) in states {
            let chosen: Vec<&LogEntry> = epoch
                .iter()
                .filter(|e| {
                    if e.entry.flags & FUA != 0 {
                        fua.iter().position(|f| f.index == e.index).is_some_and(|p| p < k)
                    } else {
                        plain
                            .iter()
                            .position(|p| p.index == e.index)
                            .is_some_and(|p| set[p])
                    }
                })
                .collect();
            let bytes: u64 = chosen.iter().map(|e| e.bytes).sum();
            if bytes > MAX_STATE_BYTES {
                return Err(format!(
                    "a crash state after entry {} changes {bytes} bytes, more than {MAX_STATE_BYTES} to undo",
                    after.map_or(0, |a| a + 1)
                ).into());
            }
            // save what the chosen entries overwrite, in order, to undo it
            let mut undo: Vec<(u64, Vec<u8>)> = Vec::with_capacity(chosen.len());
            for e in &chosen {
                let mut old = vec![0u8; e.bytes as usize];
                tf.read_exact_at(&mut old, e.at)
                    .or_else(|err| {
                        // past the target's end reads short: what is not there is zeroes
                        if err.kind() == std::io::ErrorKind::UnexpectedEof {
                            Ok(())
                        } else {
                            Err(err)
                        }
                    })
                    .map_err(|err| format!("{tname}: reading byte {}: {err}", e.at))?;
                undo.push((e.at, old));
                r.apply(e, tf, tname, buf)?;
            }
            out.states += 1;
            let verdict = self.judge.judge(tname)?;
            for (at, old) in undo.iter().rev() {
                tf.write_all_at(old, *at)
                    .map_err(|err| format!("{tname}: undoing byte {at}: {err}"))?;
            }
            if let Some(why) = verdict {
                return Ok(Some(self.refused(&why, &chosen)));
            }
        }
        Ok(None)
    }

    /// The states to try: a subset of the `n` plain writes (a bit each) and a
    /// prefix of the `fuas` FUA writes; all of them when there are at most
    /// `max_states`, else that many drawn by `rng`, the empty and the full state
    /// among them.
    fn states(
        n: u32,
        fuas: usize,
        max_states: u64,
        rng: &mut crate::rng::XorShift,
        out: &mut Checked,
    ) -> Vec<(Vec<bool>, usize)> {
        let prefixes = fuas as u64 + 1;
        let all = 1u64.checked_shl(n).and_then(|s| s.checked_mul(prefixes));
        match all {
            Some(total) if total <= max_states.max(2) => (0..total)
                .map(|s| {
                    let bits = s / prefixes;
                    ((0..n).map(|b| bits >> b & 1 == 1).collect(), (s % prefixes) as usize)
                })
                .collect(),
            _ => {
                out.sampled += 1;
                let mut v = vec![(vec![false; n as usize], 0), (vec![true; n as usize], fuas)];
                while (v.len() as u64) < max_states.max(2) {
                    let set = (0..n).map(|_| rng.below(2) == 1).collect();
                    v.push((set, rng.below(prefixes) as usize));
                }
                v
            }
        }
    }

    /// What a refused state says: the check's status and words, the entries it
    /// holds and leaves out, and the command that rebuilds it.
    fn refused(&self, why: &str, chosen: &[&LogEntry]) -> String {
        let (epoch, after) = (self.entries, self.after);
        let with: Vec<String> = chosen.iter().map(|e| e.index.to_string()).collect();
        let left: Vec<String> = epoch
            .iter()
            .filter(|e| !chosen.iter().any(|c| c.index == e.index))
            .map(|e| e.index.to_string())
            .collect();
        format!(
            "the check refused a crash state: {}, with entries [{}] of the {} written since and without [{}]: {}\n  rebuild it: dmkit replay {} IMAGE --until entry:{}{}",
            after.map_or("before the first flush".to_string(), |a| format!("after the flush at entry {a}")),
            with.join(","),
            epoch.len(),
            left.join(","),
            why,
            self.log,
            after.map_or(0, |a| a + 1),
            if with.is_empty() {
                String::new()
            } else {
                format!(" --with-entries {}", with.join(","))
            }
        )
    }
}
