//! A tensor's changes range by range, as the scan kernel writes them (`varint` gaps, `abs` or `diff` values), and
//! their joining into one tensor's `varint` streams: each range's first gap depends on the range before it, so
//! it is written in when the ranges are joined.

use super::varint;

/// The changes found in one range of elements, in the `varint` position codec and the `abs` or `diff` value codec.
/// A clone's streams are exactly their length.
#[derive(Default, Clone)]
pub struct Changes {
    pub count: u64,
    /// Position of the first change; its gap is not in `positions` (it depends on the range before this one).
    pub first_position: u64,
    pub last_position: u64,
    /// Gap varints after the first change.
    pub positions: Vec<u8>,
    pub values: Vec<u8>,
}

impl Changes {
    /// Appends the changes of the range after this one.
    pub fn append(&mut self, next: Changes) {
        if next.count == 0 {
            return;
        }
        if self.count == 0 {
            *self = next;
            return;
        }
        varint::write(&mut self.positions, next.first_position - self.last_position - 1);
        self.positions.extend_from_slice(&next.positions);
        self.values.extend_from_slice(&next.values);
        self.count += next.count;
        self.last_position = next.last_position;
    }
}

/// Byte lengths of the position and value streams that `join_streams` makes of `parts`.
pub fn joined_lens(parts: &[Changes]) -> (usize, usize) {
    let (mut positions, mut values, mut previous_end) = (0usize, 0usize, 0u64);
    for part in parts.iter().filter(|p| p.count > 0) {
        positions += varint::len(part.first_position - previous_end) + part.positions.len();
        values += part.values.len();
        previous_end = part.last_position + 1;
    }
    (positions, values)
}

/// One tensor's `varint` position stream and its value stream, from the changes of its consecutive ranges
/// (each range's first gap, which depends on the range before it, written in here).
pub fn join_streams(parts: &[Changes]) -> (Vec<u8>, Vec<u8>) {
    let (positions_len, values_len) = joined_lens(parts);
    let mut joined = Joined::default();
    joined.positions.reserve_exact(positions_len);
    joined.values.reserve_exact(values_len);
    for part in parts {
        joined.append(part);
    }
    (joined.positions, joined.values)
}

/// A tensor's `varint` position stream and value stream, built by appending the changes of its consecutive ranges
/// in order.
#[derive(Default)]
pub struct Joined {
    pub count: u64,
    pub last_position: Option<u64>,
    pub positions: Vec<u8>,
    pub values: Vec<u8>,
}

impl Joined {
    /// Appends the changes of the range after the last one appended, writing their first gap.
    pub fn append(&mut self, part: &Changes) {
        if part.count == 0 {
            return;
        }
        let previous_end = self.last_position.map_or(0, |last| last + 1);
        varint::write(&mut self.positions, part.first_position - previous_end);
        self.positions.extend_from_slice(&part.positions);
        self.values.extend_from_slice(&part.values);
        self.count += part.count;
        self.last_position = Some(part.last_position);
    }

    /// The position and value streams, shrunk to their length.
    pub fn into_streams(mut self) -> (Vec<u8>, Vec<u8>) {
        self.positions.shrink_to_fit();
        self.values.shrink_to_fit();
        (self.positions, self.values)
    }
}

/// A tensor's streams while the changes of its consecutive ranges ("chunks") come in, in any order: a chunk is
/// appended as soon as every chunk before it is in, straight from the caller's buffer; one that comes early waits
/// as a copy.
pub struct InOrder {
    next: usize,
    joined: Joined,
    waiting: Vec<Option<Changes>>,
    /// Streams are not reserved beyond this many bytes (the tensor's size: larger streams are not kept).
    cap: usize,
}

impl InOrder {
    /// Appends `chunks` chunks to `joined` (empty, or the streams of the ranges before them).
    pub fn new(joined: Joined, chunks: usize, cap: usize) -> Self {
        InOrder { next: 0, joined, waiting: (0..chunks).map(|_| None).collect(), cap }
    }

    /// Takes chunk `chunk`'s changes; returns the streams once the last chunk is appended (to exactly one caller).
    pub fn add(&mut self, chunk: usize, changes: &Changes) -> Option<Joined> {
        if chunk != self.next {
            self.waiting[chunk] = Some(changes.clone());
            return None;
        }
        if self.next == 0 {
            // Room for every chunk, guessed from the first, so that the streams rarely grow by copying.
            let left = self.waiting.len() as u64;
            let guess = |len: usize| (len as u64 * left + len as u64 * left / 8 + 64).min(self.cap as u64) as usize;
            self.joined.positions.reserve(guess(changes.positions.len()));
            self.joined.values.reserve(guess(changes.values.len()));
        }
        self.joined.append(changes);
        self.next += 1;
        while let Some(waiting) = self.waiting.get_mut(self.next).and_then(Option::take) {
            self.joined.append(&waiting);
            self.next += 1;
        }
        (self.next == self.waiting.len()).then(|| std::mem::take(&mut self.joined))
    }
}
