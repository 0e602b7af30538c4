//! An independent GGUF writer for the tests, written from the format's description (not from
//! tp-gguf), that records where every field lies so a test can patch it. It lays a file out as
//! the `gguf` Python package does (checked byte for byte in tests/python_written.rs): header,
//! metadata, tensor infos, zeros to the alignment, then each tensor's bytes padded with zeros to
//! the alignment.

/// A metadata value to write. `Raw` writes any type number with any payload.
#[derive(Clone, Debug)]
pub enum V {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(Vec<u8>),
    /// Element type number and elements (their payloads are written without type numbers).
    Arr(u32, Vec<V>),
    U64(u64),
    I64(i64),
    F64(f64),
    Raw(u32, Vec<u8>),
}

pub fn s(text: &str) -> V {
    V::Str(text.as_bytes().to_vec())
}

/// A string as GGUF stores it: u64 length, bytes.
pub fn gguf_string(bytes: &[u8]) -> Vec<u8> {
    let mut out = (bytes.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(bytes);
    out
}

impl V {
    pub fn type_id(&self) -> u32 {
        match self {
            V::U8(_) => 0,
            V::I8(_) => 1,
            V::U16(_) => 2,
            V::I16(_) => 3,
            V::U32(_) => 4,
            V::I32(_) => 5,
            V::F32(_) => 6,
            V::Bool(_) => 7,
            V::Str(_) => 8,
            V::Arr(..) => 9,
            V::U64(_) => 10,
            V::I64(_) => 11,
            V::F64(_) => 12,
            V::Raw(t, _) => *t,
        }
    }

    /// The value's bytes after its type number.
    pub fn payload(&self) -> Vec<u8> {
        match self {
            V::U8(v) => v.to_le_bytes().to_vec(),
            V::I8(v) => v.to_le_bytes().to_vec(),
            V::U16(v) => v.to_le_bytes().to_vec(),
            V::I16(v) => v.to_le_bytes().to_vec(),
            V::U32(v) => v.to_le_bytes().to_vec(),
            V::I32(v) => v.to_le_bytes().to_vec(),
            V::F32(v) => v.to_le_bytes().to_vec(),
            V::Bool(v) => vec![*v as u8],
            V::Str(b) => gguf_string(b),
            V::Arr(elem, items) => {
                let mut out = elem.to_le_bytes().to_vec();
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    out.extend(item.payload());
                }
                out
            }
            V::U64(v) => v.to_le_bytes().to_vec(),
            V::I64(v) => v.to_le_bytes().to_vec(),
            V::F64(v) => v.to_le_bytes().to_vec(),
            V::Raw(_, b) => b.clone(),
        }
    }
}

struct Tensor {
    name: Vec<u8>,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
    offset: Option<u64>,
}

/// A GGUF file to build.
pub struct Builder {
    pub version: u32,
    /// Pads the infos and the tensors to this (set `general.alignment` separately with `kv`).
    pub alignment: usize,
    kvs: Vec<(Vec<u8>, V)>,
    tensors: Vec<Tensor>,
}

/// Where one tensor info's fields lie in the built file.
#[derive(Clone, Copy, Debug)]
pub struct InfoAt {
    pub start: usize,
    pub n_dims: usize,
    pub dims: usize,
    pub type_id: usize,
    pub offset: usize,
}

/// A built file and where its fields lie.
pub struct Built {
    pub bytes: Vec<u8>,
    /// Each metadata pair's first byte (its key's length).
    pub kv_at: Vec<usize>,
    /// Each metadata value's type number.
    pub type_at: Vec<usize>,
    pub info_at: Vec<InfoAt>,
    /// Where the data section starts.
    pub data_start: usize,
    /// Where the last tensor's bytes end (before its padding).
    pub data_end: usize,
}

impl Built {
    pub fn patch(&mut self, at: usize, bytes: &[u8]) -> &mut Self {
        self.bytes[at..at + bytes.len()].copy_from_slice(bytes);
        self
    }

    pub fn patch_u32(&mut self, at: usize, v: u32) -> &mut Self {
        self.patch(at, &v.to_le_bytes())
    }

    pub fn patch_u64(&mut self, at: usize, v: u64) -> &mut Self {
        self.patch(at, &v.to_le_bytes())
    }
}

impl Default for Builder {
    fn default() -> Self {
        Builder { version: 3, alignment: 32, kvs: Vec::new(), tensors: Vec::new() }
    }
}

impl Builder {
    pub fn new() -> Builder {
        Builder::default()
    }

    pub fn kv(mut self, key: &str, v: V) -> Builder {
        self.kvs.push((key.as_bytes().to_vec(), v));
        self
    }

    pub fn kv_bytes(mut self, key: &[u8], v: V) -> Builder {
        self.kvs.push((key.to_vec(), v));
        self
    }

    /// A tensor placed after the previous one's padded bytes.
    pub fn tensor(self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Builder {
        self.tensor_bytes(name.as_bytes(), dims, type_id, data, None)
    }

    /// A tensor with any name bytes and, if given, a stated offset (its bytes still follow the
    /// previous tensor's).
    pub fn tensor_bytes(
        mut self,
        name: &[u8],
        dims: &[u64],
        type_id: u32,
        data: Vec<u8>,
        offset: Option<u64>,
    ) -> Builder {
        self.tensors.push(Tensor { name: name.to_vec(), dims: dims.to_vec(), type_id, data, offset });
        self
    }

    pub fn build(&self) -> Built {
        let pad = |n: usize| n.div_ceil(self.alignment) * self.alignment;
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        let (mut kv_at, mut type_at, mut info_at) = (Vec::new(), Vec::new(), Vec::new());
        for (key, v) in &self.kvs {
            kv_at.push(b.len());
            b.extend(gguf_string(key));
            type_at.push(b.len());
            b.extend_from_slice(&v.type_id().to_le_bytes());
            b.extend(v.payload());
        }
        let mut next = 0u64;
        for t in &self.tensors {
            let start = b.len();
            b.extend(gguf_string(&t.name));
            let n_dims = b.len();
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            let dims = b.len();
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            let type_id = b.len();
            b.extend_from_slice(&t.type_id.to_le_bytes());
            let offset = b.len();
            b.extend_from_slice(&t.offset.unwrap_or(next).to_le_bytes());
            next += pad(t.data.len()) as u64;
            info_at.push(InfoAt { start, n_dims, dims, type_id, offset });
        }
        b.resize(pad(b.len()), 0);
        let data_start = b.len();
        let mut data_end = data_start;
        for t in &self.tensors {
            b.extend_from_slice(&t.data);
            data_end = b.len();
            b.resize(pad(b.len()), 0);
        }
        Built { bytes: b, kv_at, type_at, info_at, data_start, data_end }
    }
}
