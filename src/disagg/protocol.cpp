#include "disagg/protocol.h"

namespace tandem {

void put_step_output(ByteWriter& w, const StepOutput& o) { fields(w, o); }

StepOutput get_step_output(ByteReader& r) {
  StepOutput o;
  fields(r, o);
  return o;
}

std::vector<uint8_t> encode_step_output(const StepOutput& o) {
  return codec::encode(o, kProtocolFormat);
}

StepOutput decode_step_output(const uint8_t* data, size_t size) {
  return codec::decode<StepOutput>({data, size}, kProtocolFormat);
}

void put_request(ByteWriter& w, const GenRequest& r) { fields(w, r); }

GenRequest get_request(ByteReader& rd) {
  GenRequest r;
  fields(rd, r);
  return r;
}

void put_descriptor(ByteWriter& w, const transfer::TransferDescriptor& d) { fields(w, d); }

transfer::TransferDescriptor get_descriptor(ByteReader& r) {
  transfer::TransferDescriptor d;
  fields(r, d);
  return d;
}

void put_histogram(ByteWriter& w, const HistogramCounts& h) { fields(w, h); }

HistogramCounts get_histogram(ByteReader& r) {
  HistogramCounts h;
  fields(r, h);
  return h;
}

void put_stats(ByteWriter& w, const EngineStats& s) { fields(w, s); }

EngineStats get_stats(ByteReader& r) {
  EngineStats s;
  fields(r, s);
  return s;
}

ForwardBatch PrefillStep::forward() const {
  ForwardBatch b;
  for (const Seq& s : seqs) {
    b.seqs.push_back({s.tokens.data(), static_cast<int64_t>(s.tokens.size()), s.start,
                      s.table.data(), static_cast<int64_t>(s.table.size()), s.logits,
                      s.state_slot});
  }
  return b;
}

std::vector<uint8_t> encode_prefill_step(const PrefillStep& st) {
  return codec::encode(st, kProtocolFormat);
}

PrefillStep decode_prefill_step(const std::vector<uint8_t>& bytes) {
  return codec::decode<PrefillStep>(bytes, kProtocolFormat);
}

std::vector<uint8_t> encode_decode_commands(const DecodeCommands& c) {
  return codec::encode(c, kProtocolFormat);
}

DecodeCommands decode_decode_commands(const std::vector<uint8_t>& bytes) {
  return codec::decode<DecodeCommands>(bytes, kProtocolFormat);
}

std::vector<uint8_t> encode_decode_report(const DecodeReport& r) {
  return codec::encode(r, kProtocolFormat);
}

DecodeReport decode_decode_report(const std::vector<uint8_t>& bytes) {
  return codec::decode<DecodeReport>(bytes, kProtocolFormat);
}

}  // namespace tandem
